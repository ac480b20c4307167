"""The GPU tests' dummy-weight rescaling, and SGLang's custom-loader path that runs it on every rank."""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

GPU_TESTS = Path(__file__).resolve().parents[1] / "gpu"


def dummy_model() -> torch.nn.Module:
    """Parameters named as in the hosts' Qwen3 models, filled like their dummy loaders (+-1e-3)."""
    model = torch.nn.Module()
    model.embed_tokens = torch.nn.Embedding(4096, 64)
    model.input_layernorm = torch.nn.Module()
    model.input_layernorm.weight = torch.nn.Parameter(torch.empty(64))
    model.qkv_proj = torch.nn.Linear(256, 512, bias=False)
    model.w13_weight = torch.nn.Parameter(torch.empty(8, 128, 1024))  # stacked experts, fan-in last
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-1e-3, 1e-3)
    return model


def assert_rescaled(model: torch.nn.Module) -> None:
    assert torch.equal(model.input_layernorm.weight, torch.ones(64))
    assert model.embed_tokens.weight.std().item() == pytest.approx(0.05, rel=0.05)
    assert model.qkv_proj.weight.std().item() == pytest.approx(256**-0.5, rel=0.05)
    assert model.w13_weight.std().item() == pytest.approx(1024**-0.5, rel=0.05)


def test_rescale_spreads_norms_matrices_and_embeddings(gpu_test_module):
    model = dummy_model()
    with pytest.raises(AssertionError):
        assert_rescaled(model)  # the host's dummy weights fail the check the rescaled ones pass
    gpu_test_module("dummy_weights").rescale(model)
    assert_rescaled(model)


def test_rescale_loaded_refuses_tensors(gpu_test_module):
    with pytest.raises(ValueError, match="sent 1 tensors"):
        gpu_test_module("dummy_weights").rescale_loaded(dummy_model(), [("x", torch.zeros(1))])


@pytest.mark.sglang
def test_sglang_weight_updater_runs_the_loader_by_name(monkeypatch, gpu_test_module):
    """The real SGLang ``WeightUpdater`` imports the loader by its name and calls it on the model."""
    pytest.importorskip("sglang")
    from sglang.srt.model_executor.model_runner_components import weight_updater
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    if hasattr(weight_updater, "get_model"):  # from 0.5.20 the mode is read from SGLang's published config
        monkeypatch.setattr(weight_updater, "get_model", lambda: SimpleNamespace(weight_cache_mode="off"))
    loader = gpu_test_module("test_sglang_gpu").RESCALE_LOADER
    monkeypatch.syspath_prepend(str(GPU_TESTS))  # as the engine test's PYTHONPATH does for the schedulers
    model = dummy_model()
    updater = WeightUpdater(
        tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders=[loader],
        get_model=lambda: model, update_model_fields=lambda **_: None, recapture_cuda_graph=lambda: None,
        get_model_runner=lambda: SimpleNamespace(server_args=SimpleNamespace(weight_cache_mode="off")),
    )
    rank = contextlib.nullcontext()
    if hasattr(weight_updater, "get_parallel"):  # from 0.5.23 the TP rank is read from SGLang's context too
        rank = weight_updater.get_parallel().override(tp_rank=0)
    with rank:
        assert updater.update_weights_from_tensor([], load_format=loader) == (True, "Success")
    assert_rescaled(model)
