"""The plugin's one validated configuration object.

Every host reads the same keys (vLLM from ``additional_config["bcg"]``, SGLang from its flags or
environment); :meth:`BcgConfig.from_mapping` is the only way in, so a bad value is reported once, at
engine start, naming the key, instead of as a traceback from deep inside a capture.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from bcg_plugin.errors import BcgConfigError

ENV_PREFIX = "BCG_"  # BCG_ENABLE=1, BCG_MAX_TOKENS=2048, BCG_SIZES=16,32,64 ...
WARMUP_POLICIES = ("every_bucket", "first_bucket")
ATTENTION_CHOICES = ("auto", "graph", "break")


@dataclasses.dataclass(frozen=True)
class BcgConfig:
    """What the runtime captures and when it replays.

    Attributes:
        enable: capture and replay prefill graphs at all; off by default so installing the plugin
            changes nothing until a user asks for it.
        max_tokens: the top bucket. ``None`` means the most tokens one host step can run: its chunk
            size, or less where no step can fill a chunk (vLLM: ``max_num_seqs`` x
            ``max_model_len``; SGLang: its request pool's rows x ``context_length``), and on SGLang
            where it scatters a step's rows between attention-TP ranks the chunk padded to a
            multiple of their count, as SGLang pads a full chunk; ``0`` disables capture, like the
            hosts' own "0 turns graphs off" convention.
        sizes: an explicit bucket list replacing the reference ladder; every size must be
            ``<= max_tokens`` when both are given, and within the most tokens one host step can
            run (see ``max_tokens``; vLLM refuses larger sizes at engine start, SGLang those above
            its prefill graphs' ceiling, its chunk by default, before any scheduler starts, and
            those above what its request pool holds in the scheduler). Where the host splits a
            step's rows into equal shards (vLLM's sequence parallelism; SGLang where it scatters
            them between attention-TP ranks), each bucket, listed or from the ladder, is rounded
            up to a multiple of their count (the top one down, within ``max_tokens``: a step
            padded past it runs eagerly).
        max_padding_ratio: replay only when ``bucket <= ratio * num_tokens``; above it the padded
            tail costs more than the launches a graph saves (pitfall 11). ``None``: always.
        capture_failure: ``"eager"`` keeps the engine serving eagerly (agreed by every rank) when a
            capture fails for a reason other than out-of-memory or an error that leaves the GPU
            unusable (those fail the boot with advice either way); ``"raise"`` fails the boot.
        warmup: ``"every_bucket"`` runs one eager forward at each bucket's size before capturing
            it, so lazy initialisation and per-shape autotuning stay out of every graph;
            ``"first_bucket"`` warms up only the first (largest) bucket, and the first with attention
            inside the graph where larger ones break, and captures the others directly, retrying a
            bucket after its own warm-up if its direct capture fails. Both adapters default to
            ``"first_bucket"``; docs/validation.md lists the engine tests run under it.
        torch_compile: keep the host's torch.compile of the model body and capture the compiled code
            (attention where ``attention`` puts it), so graph-bound sizes get the compiler's fused kernels
            too. vLLM only (its piecewise compilation already splits the body at attention); off,
            the adapter turns torch.compile off and captures the plain PyTorch model. The vLLM
            adapter defaults to on, keeping the compilation vLLM is configured with.
        attention: where a bucket's attention runs. ``"graph"``: inside the captured graph in every
            bucket, where the host can run attention from buffers fixed per bucket (its full-graph
            metadata; vLLM 0.28 and later: the V2 runner with FLASH_ATTN (FA3) or TRITON_ATTN, a
            ``cudagraph_mode`` with FULL graphs, no data parallelism; FA3's graph bound is raised
            from ``max_cudagraph_capture_size`` to the top bucket; SGLang: the flashinfer or fa3 backend
            without DP attention, sliding-window or cross attention), so a batch replays one graph
            with no eager step; elsewhere every bucket breaks. ``"break"``: an eager call between
            graph segments in every bucket, sized for the live batch. ``"auto"``: the host's
            default per bucket (vLLM: inside the graph in buckets up to 2048 tokens, or up to
            ``max_cudagraph_capture_size`` if that is larger; larger buckets break, where an eager
            call sized for the live batch beats the grid captured for the bucket's worst case;
            SGLang: inside the graph in buckets up to 512 tokens on flashinfer and 1024 on fa3,
            larger ones break). The choice per bucket is logged with the capture summary and shown
            by ``bcg doctor``.
        graph_variants: also capture the buckets whose attention is inside the graph as the host's
            variants of them, each serving the steps its attention kernel suits, at one more capture
            per bucket a variant covers; off, each bucket is one graph. SGLang with flashinfer 0.7.2
            or later: ``fresh``, the ragged prefill without split KV, for steps whose requests have
            no cached prefix. SGLang with flashinfer or fa3: ``break``, a few buckets with attention
            breaking, for steps of more requests than the request slots, which without it pad to the
            next bucket that breaks or run eagerly. The capture summary names the buckets each
            variant covers. On by default: on SGLang 0.5.23 with flashinfer the ``fresh`` variant
            made the Qwen3-0.6B shape's 16-512-token requests 6-14% faster end to end, for about 1 s
            more capture and 0.03 GiB more graph memory (docs/benchmarks.md); fa3's five ``break``
            buckets take an estimated 0.02 GiB on the same shape.
    """

    enable: bool = False
    max_tokens: int | None = None
    sizes: tuple[int, ...] | None = None
    max_padding_ratio: float | None = None
    capture_failure: str = "eager"
    warmup: str = "every_bucket"
    torch_compile: bool = False
    attention: str = "auto"
    graph_variants: bool = True

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None, *, source: str = "bcg config") -> BcgConfig:
        """Validate ``raw`` (JSON-like) into a config; raise :class:`BcgConfigError` naming the key."""
        if raw is None:
            return cls()
        if isinstance(raw, BcgConfig):
            return raw
        if not isinstance(raw, Mapping):
            raise BcgConfigError(
                f"{source}: expected a JSON object such as {{\"enable\": true}}, got {type(raw).__name__}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known, key=repr)  # keys of any type: a Python caller's mapping
        if unknown:
            raise BcgConfigError(
                f"{source}: unknown key(s) {', '.join(map(repr, unknown))}; "
                f"known keys are {', '.join(sorted(known))}"
            )
        values: dict[str, Any] = {}
        if "enable" in raw:
            values["enable"] = _bool(raw["enable"], "enable", source)
        if "max_tokens" in raw and raw["max_tokens"] is not None:
            values["max_tokens"] = _int(raw["max_tokens"], "max_tokens", source, minimum=0)
        if "sizes" in raw and raw["sizes"] is not None:
            values["sizes"] = _sizes(raw["sizes"], source)
        if "max_padding_ratio" in raw and raw["max_padding_ratio"] is not None:
            values["max_padding_ratio"] = _ratio(raw["max_padding_ratio"], source)
        if "capture_failure" in raw:
            mode = raw["capture_failure"]
            if mode not in ("eager", "raise"):
                raise BcgConfigError(f"{source}: 'capture_failure' must be \"eager\" or \"raise\", got {mode!r}")
            values["capture_failure"] = mode
        if "torch_compile" in raw:
            values["torch_compile"] = _bool(raw["torch_compile"], "torch_compile", source)
        if "graph_variants" in raw:
            values["graph_variants"] = _bool(raw["graph_variants"], "graph_variants", source)
        if "attention" in raw:
            choice = raw["attention"]
            if choice not in ATTENTION_CHOICES:
                raise BcgConfigError(
                    f"{source}: 'attention' must be one of {', '.join(map(json.dumps, ATTENTION_CHOICES))}, "
                    f"got {choice!r}"
                )
            values["attention"] = choice
        if "warmup" in raw:
            policy = raw["warmup"]
            if policy not in WARMUP_POLICIES:
                raise BcgConfigError(
                    f"{source}: 'warmup' must be one of {', '.join(map(json.dumps, WARMUP_POLICIES))}, got {policy!r}"
                )
            values["warmup"] = policy
        cfg = cls(**values)
        if cfg.sizes is not None and cfg.max_tokens is not None and max(cfg.sizes) > cfg.max_tokens:
            too_big = [s for s in cfg.sizes if s > cfg.max_tokens]
            raise BcgConfigError(
                f"{source}: 'sizes' has {too_big} above 'max_tokens' = {cfg.max_tokens}; "
                f"drop those sizes or raise 'max_tokens'"
            )
        return cfg

    @classmethod
    def from_json(cls, text: str, *, source: str = "bcg config") -> BcgConfig:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise BcgConfigError(f"{source}: not valid JSON ({e.msg} at column {e.colno}): {text!r}") from None
        return cls.from_mapping(raw, source=source)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> BcgConfig | None:
        """Read ``BCG_*`` variables (inherited by spawned engine processes); ``None`` if none is set."""
        env = os.environ if environ is None else environ
        raw: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            name = env_name(f.name)
            if name in env:
                text = env[name].strip()
                raw[f.name] = _env_sizes(text, name) if f.name == "sizes" else text
        return cls.from_mapping(raw, source="environment (BCG_*)") if raw else None

    def with_chunk_size(self, chunk_size: int) -> BcgConfig:
        """Resolve ``max_tokens=None`` to the host's chunk size and clamp to it."""
        top = chunk_size if self.max_tokens is None else min(self.max_tokens, chunk_size)
        return dataclasses.replace(self, max_tokens=top)

    @property
    def active(self) -> bool:
        return self.enable and self.max_tokens != 0

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.sizes is not None:
            d["sizes"] = list(self.sizes)
        return d


def env_name(key: str) -> str:
    """The ``BCG_*`` variable that sets config key ``key`` (``max_tokens``: ``BCG_MAX_TOKENS``)."""
    return ENV_PREFIX + key.upper()


def config_env_names() -> set[str]:
    """The ``BCG_*`` variables :meth:`BcgConfig.from_env` reads."""
    return {env_name(f.name) for f in dataclasses.fields(BcgConfig)}


# How alike (difflib's ratio) an unread ``BCG_*`` name must be to a read one to be taken for its
# misspelling: BCG_MAX_TOKEN, BCG_SIZE or BCG_ENABLED read 0.94 or more, while other tools' names
# under the prefix (the test and bench harness's BCG_TEST_*, BCG_SOAK_*) stay below 0.88.
MISSPELLING_CUTOFF = 0.9


def check_env_spelling(environ: Mapping[str, str], known: set[str]) -> None:
    """Raise :class:`BcgConfigError` for a ``BCG_*`` variable that is not in ``known`` but is so close
    to a name in it that it is a misspelling, which would otherwise leave the setting unread; other
    unread names under the prefix are left alone (they may be another tool's)."""
    import difflib

    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in known:
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=MISSPELLING_CUTOFF)
        if close:
            raise BcgConfigError(f"environment (BCG_*): {name} is not a variable bcg reads; did you mean "
                                 f"{close[0]}? Rename it, or unset it")


# How a boolean reads as text (environment variables, JSON strings).
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def _bool(v: Any, key: str, source: str) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in TRUE_WORDS + FALSE_WORDS:
        return v.lower() in TRUE_WORDS
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    raise BcgConfigError(f"{source}: {key!r} must be true or false, got {v!r}")


def _int(v: Any, key: str, source: str, *, minimum: int) -> int:
    if isinstance(v, bool):
        raise BcgConfigError(f"{source}: {key!r} must be an integer, got {v!r}")
    if isinstance(v, str):
        try:
            v = int(v.strip())
        except ValueError:
            raise BcgConfigError(f"{source}: {key!r} must be an integer, got {v!r}") from None
    if isinstance(v, float):
        if not v.is_integer():
            raise BcgConfigError(f"{source}: {key!r} must be an integer, got {v!r}")
        v = int(v)
    if not isinstance(v, int):
        raise BcgConfigError(f"{source}: {key!r} must be an integer, got {type(v).__name__} {v!r}")
    if v < minimum:
        raise BcgConfigError(f"{source}: {key!r} must be >= {minimum}, got {v}")
    return v


def _env_sizes(text: str, name: str) -> list[str]:
    """``BCG_SIZES``' items: integers separated by commas, each of them there (``16 32`` is not two
    sizes, nor ``16,,32`` three)."""
    if not text:
        return []
    items = [item.strip() for item in text.split(",")]
    if not all(item.isdecimal() and item.isascii() for item in items):
        raise BcgConfigError(f"environment (BCG_*): {name} must be positive integers separated by commas "
                             f"(e.g. {name}=16,32,64), got {text!r}")
    return items


def _sizes(v: Any, source: str) -> tuple[int, ...]:
    if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
        raise BcgConfigError(f"{source}: 'sizes' must be a list of positive integers, got {v!r}")
    sizes = [_int(s, "sizes", source, minimum=1) for s in v]
    if not sizes:
        raise BcgConfigError(f"{source}: 'sizes' is empty; leave it out to use the default ladder")
    if len(set(sizes)) != len(sizes):
        raise BcgConfigError(f"{source}: 'sizes' has duplicates: {sorted(sizes)}")
    return tuple(sorted(sizes))


def _ratio(v: Any, source: str) -> float:
    try:
        r = float(v)
    except (TypeError, ValueError):
        raise BcgConfigError(f"{source}: 'max_padding_ratio' must be a number >= 1, got {v!r}") from None
    if isinstance(v, bool) or not r >= 1.0:
        raise BcgConfigError(f"{source}: 'max_padding_ratio' must be a number >= 1, got {v!r}")
    return r


def reference_markdown() -> str:
    """The configuration reference (docs/configuration.md), generated from :class:`BcgConfig`."""
    import inspect

    doc = inspect.getdoc(BcgConfig) or ""
    described: dict[str, str] = {}
    current = None
    for line in doc.split("Attributes:", 1)[-1].splitlines():
        stripped = line.strip()
        head, sep, rest = stripped.partition(":")
        if sep and head in {f.name for f in dataclasses.fields(BcgConfig)} and line.startswith("    ") and not line.startswith("        "):
            current = head
            described[current] = rest.strip()
        elif current and stripped:
            described[current] += " " + stripped
    rows = [
        "# Configuration reference",
        "",
        "Generated from `bcg_plugin.config.BcgConfig` by `bcg config-reference`; do not edit by hand.",
        "",
        "The same keys everywhere: vLLM `--additional-config '{\"bcg\": {...}}'` (or `LLM(additional_config=...)`),",
        f"environment variables `{ENV_PREFIX}<KEY>` (e.g. `{ENV_PREFIX}ENABLE=1`, `{ENV_PREFIX}SIZES=16,32,64`) for engines",
        "that spawn workers (SGLang). Unknown keys and bad values fail at engine start with an error naming the key;",
        f"so does a `{ENV_PREFIX}*` variable whose name is a misspelling of one of these.",
        "",
        "| key | type | default | environment | meaning |",
        "|---|---|---|---|---|",
    ]
    for f in dataclasses.fields(BcgConfig):
        default = json.dumps(list(f.default) if isinstance(f.default, tuple) else f.default)
        rows.append(
            f"| `{f.name}` | {str(f.type).replace(' | ', ' or ')} | `{default}` | `{env_name(f.name)}` | {described.get(f.name, '')} |"
        )
    return "\n".join(rows) + "\n"
