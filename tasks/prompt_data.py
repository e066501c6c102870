"""Prompt sets from files and datasets: what a `task.name=prompts` run trains and evaluates on.

A source is a prompt file (`.txt`, `.jsonl`, `.json`, `.csv`, `.parquet`), a folder written by
`save_to_disk`, a local dataset folder or a Hugging Face dataset id. Text and JSON files are parsed
here, line by line, rather than through `datasets`: Arrow unifies the schemas of nested records (a
GenEval clause without `color` would come back with `color: None`, changing what the reward
checks), and a bad record can be reported by its line. A bad source is refused up front with the
file and line (or row) at fault, not halfway through a run.
"""
from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from tasks.base import PromptRecord

FILE_FORMATS = (".txt", ".jsonl", ".json", ".csv", ".parquet")
UTF8_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class DataPrompt:
    """A prompt read from a source; `metadata` is every other field of its record, as plain python
    values, so the reward can check the image against it (e.g. GenEval's `include` clauses)."""
    text: str
    metadata: Mapping[str, Any]


class PromptDataError(ValueError):
    """A source that cannot give prompts, named with the line (or row) at fault."""


def load_prompts(source: str, text_field: str = "prompt", split: str = "train") -> list[DataPrompt]:
    """The prompts of `source`, in order, each text stripped of surrounding whitespace; `split` is
    used by sources that have splits (a saved DatasetDict, a dataset folder or id)."""
    path = Path(source).expanduser()
    if path.is_file():
        return _load_file(path, text_field)
    if path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        return _load_saved(path, text_field, split)
    if path.is_dir():
        rows = _load_dataset(source, "loading the folder as a dataset", source, split=split)
    elif _looks_like_path(source):
        raise PromptDataError(f"{source}: no such file or folder")
    else:
        rows = _load_dataset(source, "not a local path, and loading it as a Hugging Face dataset",
                             source, split=split)
    return _prompts(_numbered(rows), f"{source} [{split}]", text_field)


def prompt_key(text: str) -> str:
    """`text` as compared for overlap: casefolded, whitespace collapsed, trailing punctuation gone,
    so that "A photo of a dog." and "a photo of a  dog" count as one prompt."""
    key = " ".join(text.casefold().split())
    end = len(key)
    while end and (key[end - 1].isspace() or unicodedata.category(key[end - 1]).startswith("P")):
        end -= 1
    return key[:end]


def overlap(train: Iterable[PromptRecord], evals: Iterable[PromptRecord]) -> list[str]:
    """The eval prompt texts (in order, once each) that are also training prompts: an eval set
    that shares prompts with training measures memory, not generalisation."""
    seen = {prompt_key(p.text) for p in train}
    return list(dict.fromkeys(p.text for p in evals if prompt_key(p.text) in seen))


# --- files ---------------------------------------------------------------------------------------- #

def _load_file(path: Path, text_field: str) -> list[DataPrompt]:
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return _prompts(((f"line {n}", {text_field: line}) for n, line in _lines(_read_text(path))),
                        str(path), text_field)
    if suffix in (".jsonl", ".json"):
        text = _read_text(path)
        records = _json_array(text, path) if suffix == ".json" and text.lstrip().startswith("[") \
            else _json_lines(text, path)
        return _prompts(records, str(path), text_field)
    if suffix == ".csv":
        if len(_lines(_read_text(path))) < 2:  # read here too: pandas reports a bad byte without its line
            raise PromptDataError(f"{path}: no prompts")  # datasets fails on a file without rows
        rows = _load_dataset(str(path), "reading the CSV file", "csv", data_files=str(path), split="train")
        return _prompts(_numbered(rows, header_lines=1), str(path), text_field)
    if suffix == ".parquet":
        _datasets(str(path))
        import pyarrow.parquet  # comes with datasets
        if pyarrow.parquet.ParquetFile(path).metadata.num_rows == 0:
            raise PromptDataError(f"{path}: no prompts")  # datasets fails on a file without rows
        rows = _load_dataset(str(path), "reading the Parquet file", "parquet", data_files=str(path),
                             split="train")
        return _prompts(_numbered(rows), str(path), text_field)
    raise PromptDataError(f"{path}: unknown prompt file type {path.suffix!r}; expected one of "
                          f"{', '.join(FILE_FORMATS)}, a saved dataset folder or a dataset id")


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    if raw.startswith(UTF8_BOM):
        raw = raw[len(UTF8_BOM):]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise PromptDataError(f"{path}, line {line}: not UTF-8 text (byte {raw[e.start]:#04x})") from None


def _lines(text: str) -> list[tuple[int, str]]:
    """Numbered lines, without the blank ones that end the file (a blank line between prompts stays,
    to be refused: it is most likely a prompt lost in editing)."""
    lines = list(enumerate(text.split("\n"), 1))
    while lines and not lines[-1][1].strip():
        lines.pop()
    return lines


def _json_lines(text: str, path: Path) -> Iterator[tuple[str, Any]]:
    for n, line in _lines(text):
        if not line.strip():
            raise PromptDataError(f"{path}, line {n}: blank line; expected one JSON object per line")
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptDataError(f"{path}, line {n}: not JSON ({e.msg}, column {e.colno})") from None
        yield f"line {n}", record


def _json_array(text: str, path: Path) -> Iterator[tuple[str, Any]]:
    try:
        records = json.loads(text)
    except json.JSONDecodeError as e:
        raise PromptDataError(f"{path}, line {e.lineno}: not JSON ({e.msg}, column {e.colno})") from None
    for i, record in enumerate(records, 1):
        yield f"item {i} of the array", record


# --- datasets ------------------------------------------------------------------------------------- #

def _datasets(source: str):
    try:
        import datasets
    except ImportError:
        raise PromptDataError(f"{source}: reading it needs the `datasets` package: "
                              "pip install 'jointrl[data]'") from None
    return datasets


def _load_dataset(name: str, doing: str, *args, **kwargs) -> list[dict]:
    """The rows of `datasets.load_dataset(*args, **kwargs)` as plain python; any failure (offline,
    unknown id, missing split, unreadable file) becomes one line naming the source, `name`."""
    datasets = _datasets(name)
    try:
        ds = datasets.load_dataset(*args, **kwargs)
    except Exception as e:  # datasets raises a dozen unrelated types for "cannot load this"
        raise PromptDataError(f"{name}: {doing} failed: {_one_line(e)}") from e
    return ds.to_list()


def _load_saved(path: Path, text_field: str, split: str) -> list[DataPrompt]:
    datasets = _datasets(str(path))
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # as in _load_dataset: a corrupt folder fails in many ways
        raise PromptDataError(f"{path}: loading the saved dataset failed: {_one_line(e)}") from e
    where = str(path)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise PromptDataError(f"{path}: no split {split!r}; the saved dataset has {', '.join(ds)}")
        ds, where = ds[split], f"{path} [{split}]"
    return _prompts(_numbered(ds.to_list()), where, text_field)


def _numbered(rows: list[dict], header_lines: int = 0) -> Iterator[tuple[str, dict]]:
    """Rows with their 1-based number (and, for a CSV file, their line) for error messages."""
    for i, row in enumerate(rows, 1):
        yield (f"row {i} (line {i + header_lines})" if header_lines else f"row {i}"), row


def _one_line(error: Exception) -> str:
    return " ".join(f"{type(error).__name__}: {error}".split())


# --- records -------------------------------------------------------------------------------------- #

def _prompts(records: Iterable[tuple[str, Any]], where: str, text_field: str) -> list[DataPrompt]:
    """A prompt per (location, record), refusing a record without a usable text."""
    out = []
    for at, record in records:
        if not isinstance(record, dict):
            raise PromptDataError(f"{where}, {at}: the record is {_json_kind(record)}, not an object")
        if text_field not in record:
            fields = ", ".join(map(repr, record)) or "none"
            raise PromptDataError(f"{where}, {at}: no {text_field!r} field (task.text_field); "
                                  f"the record's fields: {fields}")
        value = record[text_field]
        if value is not None and not isinstance(value, str):
            raise PromptDataError(f"{where}, {at}: {text_field!r} is {_json_kind(value)}, not a string")
        text = (value or "").strip()
        if not text:
            raise PromptDataError(f"{where}, {at}: the prompt is empty")
        out.append(DataPrompt(text, {k: v for k, v in record.items() if k != text_field}))
    if not out:
        raise PromptDataError(f"{where}: no prompts")
    return out


def _json_kind(value: Any) -> str:
    for kind, types in (("null", type(None)), ("a boolean", bool), ("a number", (int, float)), ("a string", str),
                        ("an array", list), ("an object", dict)):
        if isinstance(value, types):
            return kind
    return f"a {type(value).__name__}"


def _looks_like_path(source: str) -> bool:
    """Whether `source` is meant as a path, so that a missing one is reported as missing instead of
    being looked up on the Hub; a Hub id is `name` or `owner/name`."""
    return (Path(source).suffix.lower() in FILE_FORMATS or source.startswith((".", "/", "~"))
            or "\\" in source or source.count("/") > 1)
