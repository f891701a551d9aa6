"""Metrics sinks (metrics.jsonl, TensorBoard, W&B), the one-line per-step summary, and lichen's library logger.

`metrics.jsonl` holds one strict-JSON object per `log` call: {"step": step, "<prefix>/<key>": value, ...}.
Non-finite floats (NaN, ±inf) are written as `null`, because NaN/Infinity are not valid JSON and would break
other readers; TensorBoard and W&B receive the float itself. The run config given to W&B and every line of
lichen's logger pass through the secret redaction of `lichen.observe.secrets`.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import re
import sys
import threading
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from lichen.errors import ConfigError, DataError
from lichen.observe.secrets import redact_config, redact_text

if TYPE_CHECKING:
    from lichen.config.engine_config import ObserveConfig

METRICS_FILE = "metrics.jsonl"
WANDB_MODES = ("online", "offline", "disabled")


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError as e:
        raise ConfigError(
            "--use-wandb needs the wandb package, which is not installed: run `pip install wandb` "
            "(or install lichen with the `wandb` extra: pip install 'lichen[wandb]')"
        ) from e
    return wandb


def _tensorboard_writer(log_dir: str) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ConfigError(
            "--use-tensorboard needs the tensorboard package, which is not installed: run "
            "`pip install tensorboard` (or the `tensorboard` extra: pip install "
            "'lichen[tensorboard]')"
        ) from e
    return SummaryWriter(log_dir=log_dir)


def _to_number(key: str, value: Any) -> int | float:
    """bool/int stay ints; floats, numpy scalars and 0-d tensors become float."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}: {value!r}") from e


def _json_safe(value: int | float) -> int | float | None:
    return None if isinstance(value, float) and not math.isfinite(value) else value


class MetricsLogger:
    """Writes each step's scalar metrics to `<output_dir>/metrics.jsonl` and, when enabled, TensorBoard and W&B.

    metrics.jsonl is opened in append mode and flushed after every line, so a crash loses nothing already logged
    and a resumed run continues the same file. TensorBoard events go to `<output_dir>/tensorboard`. W&B is
    imported only when enabled; `wandb_mode="offline"` needs no network and keeps its files under `output_dir`.
    `wandb_key` (else W&B's own WANDB_API_KEY / login) goes to W&B's settings, never into its config or files;
    `config` is recorded with its secrets redacted.
    """

    def __init__(
        self,
        output_dir: str,
        *,
        use_tensorboard: bool = False,
        use_wandb: bool = False,
        wandb_mode: str = "offline",
        wandb_project: str = "lichen",
        wandb_run_name: str | None = None,
        wandb_key: str | None = None,
        config: dict | None = None,
        wandb_group: str | None = None,
    ) -> None:
        if use_wandb and wandb_mode not in WANDB_MODES:
            raise ConfigError(f"--wandb-mode must be one of {', '.join(WANDB_MODES)}; got {wandb_mode!r}")
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, METRICS_FILE)
        self._lock = threading.Lock()
        self._tb: Any = None
        self._wandb_run: Any = None
        # Check optional dependencies before creating anything on disk.
        wandb = _import_wandb() if use_wandb else None
        os.makedirs(output_dir, exist_ok=True)
        self._file: Any = open(self.path, "a", encoding="utf-8")
        try:
            if use_tensorboard:
                self._tb = _tensorboard_writer(os.path.join(output_dir, "tensorboard"))
            if wandb is not None:
                extra = {"settings": wandb.Settings(api_key=wandb_key)} if wandb_key else {}
                if wandb_group:
                    extra["group"] = wandb_group
                self._wandb_run = wandb.init(
                    project=wandb_project,
                    name=wandb_run_name,
                    mode=wandb_mode,
                    dir=output_dir,
                    config=redact_config(_public(config or {})),
                    **extra,
                )
        except BaseException:
            self.close()
            raise

    @classmethod
    def for_run(cls, args: Any) -> MetricsLogger:
        """`from_config` with the ObserveConfig of the parsed flags of `lichen train` / `lichen eval`."""
        from lichen.config.engine_config import ObserveConfig

        return cls.from_config(ObserveConfig.from_args(args))

    @classmethod
    def from_config(cls, cfg: ObserveConfig) -> MetricsLogger:
        """The sinks ObserveConfig `cfg` asks for, under `cfg.output_dir`."""
        return cls(
            cfg.output_dir,
            use_tensorboard=cfg.use_tensorboard,
            use_wandb=cfg.use_wandb,
            wandb_mode=cfg.wandb_mode,
            wandb_project=cfg.wandb_project,
            wandb_run_name=cfg.wandb_run_name,
            wandb_key=cfg.wandb_key,
            config=dict(cfg.run_config),
            wandb_group=cfg.wandb_group,
        )

    def log(self, step: int, metrics: dict[str, float | int], prefix: str | None = None) -> None:
        """Record `metrics` at `step`; with `prefix`, key "k" is recorded as "prefix/k"."""
        if self._file is None:
            raise RuntimeError(f"MetricsLogger for {self.path} is closed")
        record: dict[str, int | float] = {}
        for key, value in metrics.items():
            full = f"{prefix}/{key}" if prefix else str(key)
            if full == "step":
                raise ValueError("metric name 'step' is reserved for the step number; rename the metric")
            record[full] = _to_number(full, value)
        line = json.dumps({"step": int(step), **{k: _json_safe(v) for k, v in record.items()}}, allow_nan=False)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()
            if self._tb is not None:
                for key, value in record.items():
                    self._tb.add_scalar(key, value, global_step=int(step))
                self._tb.flush()
            if self._wandb_run is not None:
                self._wandb_run.log(record, step=int(step))

    def close(self) -> None:
        """Flush and close every sink; safe to call twice."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
            if self._tb is not None:
                self._tb.close()
                self._tb = None
            if self._wandb_run is not None:
                self._wandb_run.finish()
                self._wandb_run = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _public(config: dict) -> dict:
    return {k: v for k, v in config.items() if not str(k).startswith("_")}


def read_metrics(path: str) -> list[dict]:
    """Parse a metrics.jsonl file (or a run directory holding one) into a list of dicts, in file order.

    Non-finite values come back as None (they are stored as null). A torn last line — a crash mid-write — is
    skipped; a malformed line anywhere else raises DataError naming the file and line.
    """
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_FILE)
    if not os.path.isfile(path):
        raise DataError(f"metrics file {path!r} does not exist")
    # errors="replace": a byte that is not UTF-8 (a damaged disk block) spoils its string, not the whole file
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    records: list[dict] = []
    for i, ln in enumerate(lines):
        if not ln.strip():
            continue
        try:
            obj = json.loads(ln, parse_constant=lambda _: None)  # NaN / Infinity (not lichen's writing) as None
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:  # no newline after it: the write was cut short
                break
            raise DataError(f"{path} line {i + 1}: not valid JSON ({e.msg})") from e
        except (ValueError, RecursionError) as e:  # an integer too long to convert, nesting too deep
            raise DataError(f"{path} line {i + 1}: unreadable JSON ({str(e)[:200]})") from None
        if not isinstance(obj, dict):
            raise DataError(f"{path} line {i + 1}: expected a JSON object, got {type(obj).__name__}")
        records.append(obj)
    return records


# (metric key, label, format) in the order they appear on the step line.
_STEP_FIELDS = (
    ("rollout/reward_mean", "reward", "{:.3f}"),
    ("rollout/response_length_mean", "resp_len", "{:.1f}"),
    ("rollout/tool_call_ratio", "tool_calls", "{:.2f}"),  # share of trajectories that called a tool
    ("train/loss", "loss", "{:.3f}"),
    ("train/pg_clipfrac", "clipfrac", "{:.3f}"),
    ("train/ppo_kl", "ppo_kl", "{:.1e}"),
    ("train/train_rollout_logprob_abs_diff", "lp_diff", "{:.1e}"),
)
_TIME_FIELDS = (("time/generate", "gen"), ("time/train", "train"), ("time/sync", "sync"))
_EVAL_REWARD = re.compile(r"^eval/(.+)/reward_mean$")


def _fmt_seconds(s: float) -> str:
    if not math.isfinite(s):
        return f"{s}s"
    return f"{s:.2f}s" if s < 1 else f"{s:.1f}s" if s < 100 else f"{s:.0f}s"


def format_step_line(rollout_id: int, metrics: dict) -> str:
    """One human line per step, e.g.
    `step 3/20 | reward 0.412 | resp_len 7.9 | loss -0.012 | clipfrac 0.000 | ppo_kl 0.0e+00 | lp_diff 2.1e-07 |
    eval gsm8k 0.500 | gen 3.2s train 1.1s sync 0.01s`.

    `rollout_id` is 0-based; the line counts steps from 1 so the last one reads N/N (N = metrics["num_rollout"],
    omitted when absent). Keys that are missing or None are skipped.
    """
    total = metrics.get("num_rollout")
    parts = [f"step {rollout_id + 1}/{int(total)}" if total is not None else f"step {rollout_id + 1}"]
    for key, label, fmt in _STEP_FIELDS:
        if metrics.get(key) is not None:
            parts.append(f"{label} {fmt.format(float(metrics[key]))}")
    for key, value in metrics.items():
        m = _EVAL_REWARD.match(key)
        if m and value is not None:
            parts.append(f"eval {m.group(1)} {float(value):.3f}")
    times = [
        f"{label} {_fmt_seconds(float(metrics[key]))}" for key, label in _TIME_FIELDS if metrics.get(key) is not None
    ]
    if times:
        parts.append(" ".join(times))
    return " | ".join(parts)


class _LichenFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if record.levelno >= logging.WARNING:
            msg = f"{record.levelname}: {msg}"
        text = f"[lichen] {msg}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return redact_text(text)


class _TqdmStderrHandler(logging.Handler):
    """Writes through tqdm.write so log lines do not tear a progress bar; resolves sys.stderr at emit time."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


_config_lock = threading.Lock()


def get_logger(name: str) -> logging.Logger:
    """A logger under the "lichen" hierarchy ("lichen.<name>" unless `name` already starts with "lichen").

    The first call gives the "lichen" logger one stderr handler printing "[lichen] message" (warnings and above
    carry their level) and level INFO if none was set. Only lichen's own logger is configured — never the root
    logger — and it does not propagate, so an application's logging setup neither changes nor doubles it.
    """
    with _config_lock:
        root = logging.getLogger("lichen")
        if not any(isinstance(h, _TqdmStderrHandler) for h in root.handlers):
            handler = _TqdmStderrHandler()
            handler.setFormatter(_LichenFormatter())
            root.addHandler(handler)
            root.propagate = False
            if root.level == logging.NOTSET:
                root.setLevel(logging.INFO)
    full = name if name == "lichen" or name.startswith("lichen.") else f"lichen.{name}"
    return logging.getLogger(full)
