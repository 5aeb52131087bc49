"""Trace readers: turn the public request traces into `Workload` objects.

Owns the on-disk formats (Azure LLM inference 2023 CSV, Mooncake FAST'25 JSONL),
the short names benchmarks use for them (``azure-conv``...) and where the trace
directory is found. Readers validate every row and name the file and line of a
bad one, because a silently skipped row would shift every later arrival.
"""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path

import msgspec

from loadgen.workload import TraceRequest, Workload

#: Short trace names -> file names inside the traces directory.
TRACE_FILES: dict[str, str] = {
    "azure-code": "AzureLLMInferenceTrace_code.csv",
    "azure-conv": "AzureLLMInferenceTrace_conv.csv",
    "mooncake-conv": "conversation_trace.jsonl",
    "mooncake-synthetic": "synthetic_trace.jsonl",
}

_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def default_traces_dir() -> Path:
    """``$POISE_TRACES_DIR`` if set, else ``<repo root>/../shared/traces``.

    The traces are large, licensed third-party data kept outside the repository,
    next to the checkout; the environment variable lets CI or a device machine
    point elsewhere.
    """
    env = os.environ.get("POISE_TRACES_DIR")
    if env:
        return Path(env)
    repo_root = Path(__file__).resolve().parent.parent
    return repo_root.parent / "shared" / "traces"


def _parse_azure_timestamp(text: str) -> tuple[datetime, float]:
    """Split ``2023-11-16 18:17:03.9799600`` into whole seconds and a fraction.

    ``datetime.fromisoformat`` on Python 3.11 rejects 7 fractional digits, so the
    fraction is parsed separately as a float (keeping all 7 digits).
    """
    whole, dot, fraction = text.partition(".")
    if dot and not fraction.isdigit():
        raise ValueError(f"bad fractional seconds {fraction!r}")
    moment = datetime.fromisoformat(whole)
    return moment, float("0." + fraction) if dot else 0.0


def _nonnegative_int(text: str, column: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"{column} must be >= 0, got {value}")
    return value


def _ordered(name: str, requests: list[TraceRequest]) -> Workload:
    """Build the workload, sorting by arrival (stable) if the file was not ordered.

    Arrivals were taken relative to the first row; after sorting they are
    re-based on the earliest one so the workload still starts at 0.
    """
    if any(b.arrival_s < a.arrival_s for a, b in zip(requests, requests[1:], strict=False)):
        requests = sorted(requests, key=lambda r: r.arrival_s)
        base = requests[0].arrival_s
        requests = [msgspec.structs.replace(r, arrival_s=r.arrival_s - base) for r in requests]
    return Workload(name=name, requests=requests)


def _name_for(path: Path) -> str:
    """The short trace name for a known file, else the file's stem."""
    for short, filename in TRACE_FILES.items():
        if path.name == filename:
            return short
    return path.stem


def _require_file(path: Path) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")


def read_azure_csv(path: str | os.PathLike[str], name: str | None = None) -> Workload:
    """Read an Azure LLM inference trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``).

    Arrival times are seconds since the first row. Columns are located by header
    name, so a reordered export still reads correctly.
    """
    path = Path(path)
    _require_file(path)
    with path.open("r", encoding="utf-8", newline="") as handle:
        header_line = handle.readline()
        header = [column.strip() for column in header_line.lstrip("\ufeff").split(",")]
        missing = [column for column in _AZURE_COLUMNS if column not in header]
        if missing:
            raise ValueError(f"{path}:1: not an Azure trace CSV: missing column(s) {missing}, header is {header}")
        ts_col, in_col, out_col = (header.index(column) for column in _AZURE_COLUMNS)
        width = len(header)
        requests: list[TraceRequest] = []
        first: datetime | None = None
        first_frac = 0.0
        for lineno, line in enumerate(handle, start=2):
            line = line.strip()
            if not line:
                continue
            fields = line.split(",")
            if len(fields) != width:
                raise ValueError(f"{path}:{lineno}: expected {width} fields, got {len(fields)}: {line!r}")
            try:
                moment, frac = _parse_azure_timestamp(fields[ts_col].strip())
                if first is None:
                    first, first_frac = moment, frac
                # Rounded to the source's 7 fractional digits to drop float noise.
                arrival = round((moment - first).total_seconds() + frac - first_frac, 7)
                input_tokens = _nonnegative_int(fields[in_col], "ContextTokens")
                output_tokens = _nonnegative_int(fields[out_col], "GeneratedTokens")
            except ValueError as exc:
                raise ValueError(f"{path}:{lineno}: {exc}: {line!r}") from None
            requests.append(
                TraceRequest(
                    index=len(requests),
                    arrival_s=arrival,
                    input_tokens=input_tokens,
                    output_tokens=output_tokens,
                )
            )
    return _ordered(name or _name_for(path), requests)


class _MooncakeRow(msgspec.Struct):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int] = []


_MOONCAKE_DECODER = msgspec.json.Decoder(_MooncakeRow)


def read_mooncake_jsonl(path: str | os.PathLike[str], name: str | None = None) -> Workload:
    """Read a Mooncake FAST'25 JSONL trace (``timestamp`` in ms, lengths, ``hash_ids``).

    Arrival times are seconds since the first row's timestamp.
    """
    path = Path(path)
    _require_file(path)
    requests: list[TraceRequest] = []
    first_ms: float | None = None
    with path.open("rb") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = _MOONCAKE_DECODER.decode(line)
            except msgspec.DecodeError as exc:
                text = line.decode("utf-8", "replace").strip()
                raise ValueError(f"{path}:{lineno}: bad Mooncake row ({exc}): {text[:200]!r}") from None
            if row.input_length < 0 or row.output_length < 0:
                raise ValueError(
                    f"{path}:{lineno}: lengths must be >= 0, got input_length={row.input_length} "
                    f"output_length={row.output_length}"
                )
            if first_ms is None:
                first_ms = row.timestamp
            requests.append(
                TraceRequest(
                    index=len(requests),
                    arrival_s=(row.timestamp - first_ms) / 1000.0,
                    input_tokens=row.input_length,
                    output_tokens=row.output_length,
                    hash_ids=tuple(row.hash_ids),
                )
            )
    return _ordered(name or _name_for(path), requests)


def traces_present(*names: str, traces_dir: str | os.PathLike[str] | None = None) -> bool:
    """Whether the files of the traces called ``names`` are in ``traces_dir`` (default `default_traces_dir`)."""
    directory = Path(traces_dir) if traces_dir is not None else default_traces_dir()
    return all((directory / TRACE_FILES[name]).is_file() for name in names)


def load_trace(path_or_name: str | os.PathLike[str], traces_dir: str | os.PathLike[str] | None = None) -> Workload:
    """Load a trace by short name (``azure-conv``...) or by path, dispatching on suffix.

    Short names resolve against ``traces_dir`` (default `default_traces_dir`).
    ``.csv`` files are read as Azure traces, ``.jsonl`` as Mooncake traces.
    The stress-set names (``stress-step``...) and the held-out names (``heldout-week``...) build that
    `loadgen.stress` / `loadgen.heldout` workload from the traces in ``traces_dir``.
    """
    # Imported here: loadgen.stress and loadgen.heldout read their length pools through this module.
    from loadgen.heldout import HELD_OUT_SHAPES, load_held_out
    from loadgen.stress import STRESS_WORKLOADS, load_stress

    text = os.fspath(path_or_name)
    if text in STRESS_WORKLOADS:
        return load_stress(text, traces_dir)
    if text in HELD_OUT_SHAPES:
        return load_held_out(text, traces_dir)
    if text in TRACE_FILES:
        directory = Path(traces_dir) if traces_dir is not None else default_traces_dir()
        path = directory / TRACE_FILES[text]
        if not path.is_file():
            raise FileNotFoundError(
                f"trace {text!r} not found: expected {path} (set POISE_TRACES_DIR or pass traces_dir)"
            )
        name: str | None = text
    else:
        path = Path(text)
        name = None
        if not path.is_file():
            known = ", ".join([*TRACE_FILES, *STRESS_WORKLOADS])
            raise FileNotFoundError(f"trace file not found: {path} (known short names: {known})")
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return read_azure_csv(path, name=name)
    if suffix == ".jsonl":
        return read_mooncake_jsonl(path, name=name)
    raise ValueError(f"unsupported trace format {suffix!r} for {path}: expected .csv (Azure) or .jsonl (Mooncake)")
