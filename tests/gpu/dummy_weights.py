"""Rescaling the hosts' dummy weights so that logits spread over a few nats.

vLLM's and SGLang's dummy weights are uniform in +-1e-3, which makes every logit almost equal:
top-k is meaningless and a stale replay changes logprobs by less than float noise, so a check
against eager cannot see it. vLLM runs ``rescale`` in its workers through ``LLM.apply_model``;
SGLang runs ``rescale_loaded`` as a custom weight loader (``custom_weight_loader`` and
``Engine.update_weights_from_tensor`` with no tensors), on every TP rank.

The functions live in their own importable module so that they are pickled (vLLM) and imported
(SGLang) by reference: a function of ``__main__`` (the GPU test re-invoked as a script) is pickled
by value on the way to a data-parallel engine core, and that copy is no longer ``__main__``'s when
the engine core pickles it again for its workers.
"""

from __future__ import annotations

import math


def rescale(model) -> None:
    """Norms to 1, matrices to 1/sqrt(fan_in), embeddings and LM head to 0.05, in place."""
    import torch

    dummy_std = 1e-3 / math.sqrt(3.0)  # uniform(-1e-3, 1e-3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif "embed_tokens" in name or "lm_head" in name:
                p.mul_(0.05 / dummy_std)
            elif p.dim() in (2, 3):  # 3-D: stacked MoE expert matrices, fan-in last
                p.mul_((1.0 / math.sqrt(p.shape[-1])) / dummy_std)


def rescale_loaded(model, named_tensors) -> None:
    """``rescale`` in the form of an SGLang custom weight loader; it is sent no tensors."""
    if named_tensors:
        raise ValueError(f"rescale_loaded rescales the weights in place; it was sent {len(named_tensors)} tensors")
    rescale(model)
