"""The rules both adapters apply, held once in the runtime: version gate, top bucket, padding, first rank,
and the fault seam the negative controls go through."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
from packaging.specifiers import SpecifierSet

from bcg_plugin import BcgConfigError, faults
from bcg_plugin.dist import first_rank
from bcg_plugin.ladder import ladder_top, ladder_top_note, padding_allows
from bcg_plugin.versions import UNTESTED_ENV, HostGate, format_range, version_problem


@pytest.mark.parametrize("found, problem", [
    ("0.5.17", None), ("0.5.17.post1", None), ("0.5.17+cu129", None),
    ("0.5.18", "sglang 0.5.18 is outside the range bcg-plugin supports (>=0.5.17,<0.5.18)"),
    ("0.5.18rc1", "outside the range"), ("0.5.16", "outside the range"),
    ("soon", "sglang version 'soon' is not a valid version"), (None, "sglang is not installed"),
])
def test_one_version_gate_for_every_host(found, problem):
    got = version_problem("sglang", "<0.5.18,>=0.5.17", found)
    assert got is None if problem is None else problem in got


@pytest.mark.parametrize("newer_packaging", [False, True])
@pytest.mark.parametrize("found, problem", [
    ("0.5.18rc1", "sglang 0.5.18rc1 is a pre-release: bcg-plugin patches the releases in >=0.5.17,<0.5.19"),
    ("0.5.18.dev12+gabc", "is a pre-release"), ("0.5.19rc1", "outside the range"), ("0.5.17rc1", "outside the range"),
    ("0.5.18", None), ("0.5.18.post1", None), ("0.5.18+cu129", None),
])
def test_a_pre_release_is_refused_whatever_packaging_is_installed(monkeypatch, newer_packaging, found, problem):
    # A pre-release falls between the descriptors' ranges, which meet at releases: it would get only
    # part of the patches. packaging from 26 lets pre-releases into `in`; earlier releases keep them out.
    monkeypatch.setattr(SpecifierSet, "__contains__",
                        lambda self, item: self.contains(item, prereleases=newer_packaging))
    got = version_problem("sglang", ">=0.5.17,<0.5.19", found)
    assert got is None if problem is None else problem in got
    gate = HostGate("sglang", ">=0.5.17,<0.5.19", ("0.5.17", "0.5.18"))
    monkeypatch.setattr(gate, "installed", lambda: found)
    assert gate.selected() == (found if problem is None else None)
    assert gate._newer(found) == (found == "0.5.19rc1")  # above the range: the untested opt-in's case


def test_ranges_read_lower_bound_first():
    assert format_range("<0.5.18,>=0.5.17") == ">=0.5.17,<0.5.18" and format_range("==0.26.0") == "==0.26.0"


@pytest.mark.parametrize("chunk, requests, context, top", [
    (8192, 2, 1024, 2048), (16384, 64, 8704, 16384), (2048, 256, 8192, 2048), (8192, 1, 8192, 8192),
])
def test_the_top_bucket_is_what_one_step_can_schedule(chunk, requests, context, top):
    assert ladder_top(chunk, requests, context) == top
    note = ladder_top_note(chunk, requests, context, ("max_num_batched_tokens", "max_num_seqs", "max_model_len"))
    if top == chunk:
        assert note is None
    else:
        assert note == (f"bcg: prefill graphs up to {top} tokens, what {requests} requests (max_num_seqs) of "
                        f"{context} tokens (max_model_len) hold; max_num_batched_tokens ({chunk}) is more than a "
                        "step can schedule")


def test_padding_ratio_bounds_the_bucket_a_batch_replays_in():
    assert padding_allows(64, 40, None) and padding_allows(64, 40, 1.6) and not padding_allows(64, 40, 1.5)


def test_the_first_rank_logs_for_its_group():
    assert first_rank(lambda: 0) and not first_rank(lambda: 1)
    assert first_rank(lambda: None)  # no group: a group of one

    def no_group():
        raise AssertionError("tensor model parallel group is not initialized")

    assert first_rank(no_group)


def test_without_a_fault_plugin_replays_read_the_live_metadata(fresh_faults, monkeypatch):
    monkeypatch.delenv(faults.FAULTS_ENV, raising=False)
    assert not faults.active() and faults.replay_metadata("vllm", 64, live="live", earlier="old") == "live"


def test_the_fault_module_named_in_the_environment_picks_the_metadata(fresh_faults, monkeypatch):
    plugin = types.ModuleType("bcg_test_fault_plugin")
    plugin.bcg_replay_metadata = faults.hookimpl(lambda earlier: earlier)
    monkeypatch.setitem(sys.modules, plugin.__name__, plugin)
    monkeypatch.setenv(faults.FAULTS_ENV, plugin.__name__)
    assert faults.active()
    assert faults.replay_metadata("sglang", 64, live="live", earlier="old") == "old"
    assert faults.replay_metadata("sglang", 64, live="live", earlier=None) == "live"  # nothing in bounds to offer


def test_a_fault_module_that_does_not_import_is_named(fresh_faults, monkeypatch):
    monkeypatch.setenv(faults.FAULTS_ENV, "bcg_no_such_fault_plugin")
    with pytest.raises(BcgConfigError, match="BCG_TEST_FAULTS='bcg_no_such_fault_plugin': cannot import"):
        faults.active()


@pytest.mark.parametrize("host", [pytest.param(h, marks=getattr(pytest.mark, h)) for h in ("vllm", "sglang")])
def test_the_version_gate_refuses_a_torch_outside_the_checked_range(host, monkeypatch):
    pytest.importorskip(host)
    import torch

    gate = importlib.import_module(f"bcg_plugin.adapters.{host}.version")
    if version_problem(host, gate.supported(), gate.installed()) is not None:
        pytest.skip(f"the installed {host} is not one bcg supports")
    assert gate.problem() is None  # the host's own version passes, torch as installed here
    monkeypatch.setattr(torch, "__version__", "2.15.0")
    assert "torch 2.15.0 is outside the range" in gate.problem()


def toy_gate(monkeypatch, found):
    gate = HostGate("toyhost", ">=1.0,<1.3", ("1.0", "1.1", "1.2"))
    monkeypatch.setattr(gate, "installed", lambda: found)
    return gate


@pytest.mark.parametrize("found, selected, nearest", [
    ("1.1", "1.1", "1.1"), ("1.1.post1", "1.1.post1", "1.1"), ("1.3", None, "1.2"), ("0.9", None, "1.0"),
    (None, None, None),
])
def test_a_gate_selects_the_installed_release_and_the_nearest_for_launch_patches(monkeypatch, found, selected,
                                                                                 nearest):
    monkeypatch.delenv(UNTESTED_ENV, raising=False)
    gate = toy_gate(monkeypatch, found)
    assert gate.selected() == selected and gate.nearest() == nearest


def test_a_newer_release_runs_only_on_the_untested_opt_in_with_the_newest_descriptors(monkeypatch):
    monkeypatch.delenv(UNTESTED_ENV, raising=False)
    gate = toy_gate(monkeypatch, "1.4")
    problem = gate.problem("1.4")
    assert "toyhost 1.4 is outside the range bcg-plugin supports (>=1.0,<1.3)" in problem and UNTESTED_ENV in problem
    assert gate.selected() is None and not gate.untested("1.4")
    monkeypatch.setenv(UNTESTED_ENV, "1")
    assert gate.untested("1.4") and gate.problem("1.4") is None and gate.selected() == "1.2"
    # An older release than every validated one is never "untested newer".
    assert not gate.untested("0.9") and "outside" in gate.problem("0.9")
    assert UNTESTED_ENV not in gate.problem("0.9")  # the opt-in cannot help an older release: no hint


@pytest.mark.parametrize("value, opted_in", [("TRUE", True), ("on", True), (" yes ", True), ("0", False),
                                             ("off", False), ("maybe", None)])
def test_the_untested_opt_in_reads_as_the_configurations_booleans(monkeypatch, value, opted_in):
    monkeypatch.setenv(UNTESTED_ENV, value)
    gate = toy_gate(monkeypatch, "1.4")
    assert gate.untested("1.4") == bool(opted_in)
    if opted_in is None:  # neither: said so, not taken for "not set"
        assert f"{UNTESTED_ENV}='maybe' is neither true nor false: set it to 1" in gate.problem("1.4")
    elif not opted_in:
        assert f"set {UNTESTED_ENV}=1 to try" in gate.problem("1.4")
