"""The one patch descriptor and its set, on a toy host module (no engine needed)."""

from __future__ import annotations

import sys
import types

import pytest
from packaging.specifiers import InvalidSpecifier

from bcg_plugin.patches import NOT_FILED, Patch, PatchSet, PatchTargetError, Rebind, Wrap

HOST = "bcg_toy_host"


@pytest.fixture(autouse=True)
def toy_host(monkeypatch):
    module = types.ModuleType(HOST)

    class Engine:
        def step(self, batch, budget=None):
            return ("step", batch)

        def helper(self):
            return "helper"

    module.Engine = Engine
    module.BACKENDS = ("eager", "graphs")
    monkeypatch.setitem(sys.modules, HOST, module)
    return module


def make_step(original, *, tag):
    def step(self, batch, budget=None):
        return (tag, original(self, batch, budget))

    return step


def wrap_step(params=("self", "batch", "budget"), **kw):
    return Patch(target=f"{HOST}.Engine.step", how=Wrap(params=params, **kw), make=make_step, reason="r",
                 hosts=">=1.0,<2.0", upstream=NOT_FILED, remove_when="w")


def rebind_backends(check=lambda v: None):
    def make(backends, *, flag):
        return (*backends, flag)

    return Patch(target=f"{HOST}.BACKENDS", how=Rebind(check=check), make=make, reason="r", hosts=">=1.0",
                 upstream=NOT_FILED, remove_when="w")


def test_a_wrapped_target_runs_the_wrapper_with_what_the_adapter_hands_it_and_is_removable(toy_host):
    original = toy_host.Engine.__dict__["step"]
    patch = wrap_step()
    assert patch.needs == ("tag",)
    patch.apply({"tag": "bcg"})
    assert toy_host.Engine().step(1) == ("bcg", ("step", 1)) and patch.in_place()
    assert patch.current().__bcg_patch__ is original
    patch.apply({"tag": "again"})  # re-entrant: not wrapped twice
    assert toy_host.Engine().step(1) == ("bcg", ("step", 1))
    patch.verify()  # sees through its own wrapper
    patch.unapply()
    assert toy_host.Engine.__dict__["step"] is original and not patch.applied


@pytest.mark.parametrize("patch, message", [
    (lambda: wrap_step(params=("self", "batch")), "expected parameters"),
    (lambda: Patch(target=f"{HOST}.Engine.gone", how=Wrap(params=("self",)), make=make_step, reason="r",
                   hosts=">=1", upstream=NOT_FILED, remove_when="w"), "attribute not found"),
    (lambda: Patch(target="bcg_no_such_host.Engine.step", how=Wrap(params=("self",)), make=make_step, reason="r",
                   hosts=">=1", upstream=NOT_FILED, remove_when="w"), "cannot resolve"),
    (lambda: wrap_step(uses={f"{HOST}.Engine.helper": ["self", "extra"]}), "Engine.helper: expected parameters"),
])
def test_a_changed_or_missing_target_fails_the_whole_set_and_nothing_is_applied(toy_host, patch, message):
    good = rebind_backends()
    with pytest.raises(PatchTargetError, match=message):
        PatchSet("t", [good, patch()]).apply({"tag": "x", "flag": "bcg"})
    assert toy_host.BACKENDS == ("eager", "graphs") and not good.applied


def test_what_the_adapter_does_not_hand_over_fails_verification(toy_host):
    with pytest.raises(PatchTargetError, match=r"hands the patch no \['tag'\]"):
        PatchSet("t", [rebind_backends(), wrap_step()]).apply({"flag": "bcg"})
    assert toy_host.BACKENDS == ("eager", "graphs")


def test_a_patch_that_did_not_take_undoes_the_set(toy_host):
    class NeverTakes(Wrap):
        def in_place(self, target, state):
            return False

    good = rebind_backends()
    silent = Patch(target=f"{HOST}.Engine.step", how=NeverTakes(params=("self", "batch", "budget")), make=make_step,
                   reason="r", hosts=">=1", upstream=NOT_FILED, remove_when="w")
    with pytest.raises(PatchTargetError, match="Engine.step: applied but not in place"):
        PatchSet("t", [good, silent]).apply({"tag": "x", "flag": "bcg"})
    assert toy_host.BACKENDS == ("eager", "graphs") and toy_host.Engine().step(2) == ("step", 2)


def test_a_rebound_value_is_checked_first_and_restored(toy_host):
    refused = rebind_backends(check=lambda v: None if "breakable" in v else "no 'breakable' backend")
    with pytest.raises(PatchTargetError, match="BACKENDS: no 'breakable' backend"):
        refused.apply({"flag": "bcg"})
    patch = rebind_backends()
    patch.apply({"flag": "bcg"})
    assert toy_host.BACKENDS == ("eager", "graphs", "bcg") and patch.in_place()
    patch.unapply()
    assert toy_host.BACKENDS == ("eager", "graphs")


def test_a_set_applies_the_descriptor_whose_range_holds_the_selected_release(toy_host):
    def make_new_step(original, *, tag):
        def step(self, batch, budget=None):
            return (tag + "-2.x", original(self, batch, budget))

        return step

    old = wrap_step()  # >=1.0,<2.0
    new = Patch(target=f"{HOST}.Engine.step", how=Wrap(params=("self", "batch", "budget")), make=make_new_step,
                reason="r", hosts=">=2.0,<3.0", upstream=NOT_FILED, remove_when="w")
    release = {"v": "2.1"}
    patch_set = PatchSet("toy", [old, new], select=lambda: release["v"])
    assert patch_set.active() == [new] and patch_set.active("1.5") == [old]
    patch_set.apply({"tag": "bcg"})
    assert toy_host.Engine().step(1) == ("bcg-2.x", ("step", 1)) and not old.applied
    patch_set.unapply()
    release["v"] = "3.0"  # no descriptor: nothing is applied, and the set says why
    with pytest.raises(PatchTargetError, match="no patch descriptor covers"):
        patch_set.apply({"tag": "bcg"})
    assert toy_host.Engine().step(1) == ("step", 1)


def test_a_descriptor_without_a_valid_range_or_an_upstream_entry_is_refused():
    with pytest.raises(InvalidSpecifier):
        Patch(target="x.y", how=Wrap(params=()), make=make_step, reason="r", hosts="0.26 or so", upstream=NOT_FILED,
              remove_when="w")
    with pytest.raises(ValueError, match="NOT_FILED"):
        Patch(target="x.y", how=Wrap(params=()), make=make_step, reason="r", hosts="==1.0", upstream="",
              remove_when="w")
