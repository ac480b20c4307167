"""The plugin found through each host's own plugin loader, on whichever host version is installed.

The adapter tests check the entry point metadata; these go through the code a host runs at start-up
(vLLM's ``vllm.plugins``, SGLang's ``sglang.srt.plugins``), so a host that renames its group, filters
plugins differently or loads them another way fails here.
"""

from __future__ import annotations

import pytest


@pytest.mark.vllm
def test_vllms_loader_finds_bcg_among_its_general_plugins(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    from bcg_plugin.adapters.vllm import register

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert load_plugins_by_group(DEFAULT_PLUGINS_GROUP).get("bcg") is register
    # Negative control: the same loader, told to load another plugin only, does not return bcg.
    monkeypatch.setenv("VLLM_PLUGINS", "bcg_no_such_plugin")
    assert "bcg" not in load_plugins_by_group(DEFAULT_PLUGINS_GROUP)


@pytest.mark.vllm
@pytest.mark.usefixtures("vllm_plugin_off")
def test_vllms_general_plugin_loading_registers_bcg_on_this_vllm(monkeypatch):
    pytest.importorskip("vllm")
    import vllm.plugins

    from bcg_plugin.adapters.vllm.plugin import STATE

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)  # vLLM loads plugins once per process
    assert not STATE.registered
    vllm.plugins.load_general_plugins()
    assert STATE.disabled_reason is None, STATE.disabled_reason
    assert STATE.registered


@pytest.mark.sglang
def test_sglangs_loader_finds_bcg_among_its_general_plugins(monkeypatch):
    pytest.importorskip("sglang")
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    from bcg_plugin.adapters.sglang import register

    def loaded() -> dict:  # SGLang's values: (the plugin's function, its distribution's name)
        return {name: func for name, (func, _dist) in load_plugins_by_group(GENERAL_PLUGINS_GROUP).items()}

    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    assert loaded().get("bcg") is register
    # Negative control: the same loader, told to load another plugin only, does not return bcg.
    monkeypatch.setenv("SGLANG_PLUGINS", "bcg_no_such_plugin")
    assert "bcg" not in loaded()
