"""``dp_attn._local_prefill_cuda_graph_vote``: bcg's runner casts its own DP-attention vote.

Under DP attention every rank votes, at schedule time, whether the coming step may replay prefill
graphs, and the min of the votes decides for all ranks. From SGLang 0.5.21 the vote is ``False``
for any runner that is not an instance of SGLang's ``PrefillCudaGraphRunner``, so with bcg's runner
every DP step ran eagerly (safely: all ranks alike). The hook hands bcg's runner the vote (its
``can_replay_locally`` on the rank's extend or mixed batch) and leaves any other runner to SGLang.
Decode batches vote no for bcg: SGLang's decode-to-extend conversion is for its own runner.
"""

from __future__ import annotations

from bcg_plugin.patches._patch import NOT_FILED, Patch
from bcg_plugin.patches.sglang._hook import Hook


def make(*, dp_prefill_vote):
    """``dp_prefill_vote(runner)``: ``None`` for a runner that is not bcg's, else ``vote(**kwargs)``
    taking the vote function's own keyword arguments."""

    def around_prefill_vote(original_fn, *args, **kwargs):
        vote = dp_prefill_vote(kwargs.get("prefill_graph_runner"))
        if vote is None or args:
            return original_fn(*args, **kwargs)
        return vote(**kwargs)

    return around_prefill_vote


PATCH = Patch(
    target="sglang.srt.managers.scheduler_components.dp_attn._local_prefill_cuda_graph_vote",
    how=Hook("AROUND", params=("local_batch", "prefill_graph_runner", "coordinated_prefill")),
    make=make,
    reason="let bcg's prefill runner vote on DP-attention steps: SGLang's vote refuses every runner that is "
           "not its own class, which left every DP step eager",
    hosts=">=0.5.21,<0.5.24",
    upstream=NOT_FILED,
    remove_when="SGLang's DP vote asks the installed prefill runner instead of checking its class",
)
