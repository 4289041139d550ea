"""Text files -> a `datasets` dataset (`load_text_dataset`): local jsonl / json / csv / tsv / parquet / txt files
through `datasets.load_dataset` (map-style or streaming), with errors that name the file and the line. The rows are
then tokenised number-aware by `data.pipeline.tokenize_dataset`."""
from __future__ import annotations

import glob
import json
import os
from typing import Mapping, Sequence

_EXT_TYPES = {
    ".jsonl": "json", ".json": "json", ".ndjson": "json",
    ".csv": "csv", ".tsv": "csv",
    ".parquet": "parquet", ".pq": "parquet",
    ".txt": "text",
}


def _file_list(data_files) -> list[str]:
    if isinstance(data_files, (str, os.PathLike)):
        return [os.fspath(data_files)]
    if isinstance(data_files, Mapping):
        out = []
        for v in data_files.values():
            out.extend(_file_list(v))
        return out
    if isinstance(data_files, (list, tuple)):
        out = []
        for v in data_files:
            out.extend(_file_list(v))
        return out
    raise ValueError(f"data_files must be a path, a list of paths or a dict split -> paths, got {data_files!r:.200}")


def _infer_type(path: str) -> str:
    name = path.lower()
    for comp in (".gz", ".bz2", ".xz", ".zst", ".zip"):
        if name.endswith(comp):
            name = name[: -len(comp)]
    ext = os.path.splitext(name)[1]
    if ext not in _EXT_TYPES:
        raise ValueError(
            f"cannot infer the file type of {path!r} from its extension {ext!r}; pass file_type= one of "
            "'json', 'csv', 'parquet', 'text' (known extensions: " + ", ".join(sorted(_EXT_TYPES)) + ")"
        )
    return _EXT_TYPES[ext]


def _check_files(files: list[str]) -> list[str]:
    """Local files exist (glob patterns are expanded); return the concrete paths."""
    out = []
    for f in files:
        if "://" in f:  # remote / fsspec URL: left to datasets
            out.append(f)
            continue
        if any(c in f for c in "*?["):
            hits = sorted(glob.glob(f))
            if not hits:
                raise FileNotFoundError(f"no file matches the pattern {f!r}")
            out.extend(hits)
        elif not os.path.isfile(f):
            raise FileNotFoundError(f"data file not found: {f!r} (cwd {os.getcwd()!r})")
        else:
            out.append(f)
    return out


def _open_text(path: str):
    if path.endswith(".gz"):
        import gzip
        return gzip.open(path, "rt", encoding="utf-8")
    if path.endswith(".bz2"):
        import bz2
        return bz2.open(path, "rt", encoding="utf-8")
    if path.endswith(".xz"):
        import lzma
        return lzma.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _locate_json_error(paths: Sequence[str]) -> ValueError | None:
    """The first line of a JSON-lines file that is not a JSON object, as a ValueError naming
    the file and the line (None when every line parses: the error was something else).
    When no file holds a single row, that is the error (datasets reports it as a bare StopIteration)."""
    empty = []
    for path in paths:
        if "://" in path:
            continue
        rows = 0
        try:
            with _open_text(path) as fh:
                first = fh.read(1)
                while first and first.isspace():
                    first = fh.read(1)
                if first == "[":  # a JSON array file, not JSON lines
                    fh.seek(0)
                    try:
                        rows = len(json.load(fh))
                    except json.JSONDecodeError as e:
                        return ValueError(f"{path}: line {e.lineno}: not valid JSON ({e.msg})")
                    if not rows:
                        empty.append(path)
                    continue
                fh.seek(0)
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        return ValueError(f"{path}: line {lineno}: not valid JSON ({e.msg}): {line.strip()[:120]!r}")
                    if not isinstance(obj, dict):
                        return ValueError(
                            f"{path}: line {lineno}: expected a JSON object per line, got {type(obj).__name__}: "
                            f"{line.strip()[:120]!r}"
                        )
                    rows += 1
                if not rows:
                    empty.append(path)
        except UnicodeDecodeError as e:
            return ValueError(f"{path}: not UTF-8 text ({e})")
    if empty and len(empty) == len(paths):
        return ValueError(f"{', '.join(empty)}: the file is empty (no JSON rows): nothing to load")
    return None


def _load_error(file_type: str, paths: Sequence[str], exc: BaseException) -> Exception:
    if file_type == "json":
        located = _locate_json_error(paths)
        if located is not None:
            return located
    cause = exc.__cause__ or exc
    return ValueError(f"could not load {list(paths)} as {file_type}: {type(cause).__name__}: {cause}")


def _guarded_json_stream(paths: list[str], load_kwargs: dict):
    """Generator behind the streaming JSON dataset: datasets' own json reader, file by file,
    with a parse error turned into a ValueError naming the file and line."""
    import datasets

    for path in paths:
        inner = datasets.load_dataset("json", data_files=path, split="train", streaming=True, **load_kwargs)
        try:
            yield from inner
        except Exception as e:  # noqa: BLE001 - re-raised with the file and line
            raise _load_error("json", [path], e) from e


def load_text_dataset(
    data_files,
    file_type: str | None = None,
    streaming: bool = False,
    split: str | None = "train",
    string_columns: Sequence[str] = ("text", "prompt", "completion"),
    **load_kwargs,
):
    """Load local files with `datasets.load_dataset` (no hub access; works with
    ``HF_DATASETS_OFFLINE=1``).

    data_files: a path, a glob, a list of them, or a dict split -> paths (as in datasets).
    file_type: "json" (also .jsonl), "csv" (.tsv -> tab separated), "parquet", "text";
        None infers it from the extension of the first file.
    streaming: True returns an `IterableDataset` that reads the files lazily (files bigger
        than memory); a JSON error then surfaces during iteration, also naming file and line.
    split: the split to return ("train" for plain file lists); None returns the DatasetDict.
    string_columns: CSV/TSV columns read as text as written (``12.5`` stays the string "12.5",
        a leading space is kept), whatever pandas would infer.

    Errors: a missing file -> FileNotFoundError naming it; a jsonl line that is not JSON ->
    ValueError naming the file and the line number; other parse errors -> ValueError naming
    the files and the cause.
    """
    import datasets

    files = _check_files(_file_list(data_files))
    if not files:
        raise ValueError("data_files is empty")
    if file_type is None:
        file_type = _infer_type(files[0])
    if file_type == "jsonl":
        file_type = "json"
    if file_type not in ("json", "csv", "parquet", "text"):
        raise ValueError(f"file_type must be 'json', 'csv', 'parquet' or 'text', got {file_type!r}")
    if file_type == "csv" and "sep" not in load_kwargs and "delimiter" not in load_kwargs:
        if all(f.lower().removesuffix(".gz").endswith(".tsv") for f in files):
            load_kwargs["sep"] = "\t"
    if file_type == "csv" and "converters" not in load_kwargs:
        load_kwargs["converters"] = {c: str for c in string_columns}

    if isinstance(data_files, Mapping):
        spec = {k: _check_files(_file_list(v)) for k, v in data_files.items()}
    else:
        spec = files

    if streaming and file_type == "json":
        # datasets' streaming json reader raises pyarrow errors that name neither the file nor
        # the line: wrap it (one shard per file, so split_dataset_by_node still shards by file).
        def make(paths):
            return datasets.IterableDataset.from_generator(
                _guarded_json_stream, gen_kwargs={"paths": list(paths), "load_kwargs": dict(load_kwargs)}
            )

        if isinstance(spec, dict):
            dd = datasets.IterableDatasetDict({k: make(v) for k, v in spec.items()})
            if split is None:
                return dd
            if split not in dd:
                raise ValueError(f"split {split!r} not in data_files splits {list(dd)}")
            return dd[split]
        if split not in (None, "train"):
            raise ValueError(f"split {split!r} not found: a plain file list is loaded as the 'train' split")
        ds = make(spec)
        return datasets.IterableDatasetDict({"train": ds}) if split is None else ds

    import logging

    json_log = logging.getLogger("datasets.packaged_modules.json.json")
    level = json_log.level
    json_log.setLevel(logging.CRITICAL)  # its "Failed to load JSON" log repeats what the ValueError below says
    try:
        return datasets.load_dataset(file_type, data_files=spec, split=split, streaming=streaming, **load_kwargs)
    except (FileNotFoundError, ImportError):
        raise
    except Exception as e:  # noqa: BLE001 - datasets/pyarrow errors do not name file and line
        raise _load_error(file_type, files, e) from e
    finally:
        json_log.setLevel(level)
