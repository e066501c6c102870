"""Prompt sets from files and datasets: every format, the shipped tiny sets, and every bad input
refused with the file and line (or row) at fault."""
import json
import sys
from pathlib import Path

import pytest

from tasks.prompt_data import DataPrompt, PromptDataError, load_prompts, overlap, prompt_key

DATA = Path(__file__).resolve().parent.parent / "configs" / "data"
GENEVAL = [
    {"tag": "counting", "include": [{"class": "dog", "count": 2}], "exclude": [{"class": "dog", "count": 3}],
     "prompt": "a photo of two dogs"},
    {"tag": "position", "include": [{"class": "couch", "count": 1},
                                    {"class": "bird", "count": 1, "position": ["left of", 0]}],
     "prompt": "a photo of a bird left of a couch"},
    {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}], "prompt": "a photo of a red car"},
]


def without_prompt(record):
    return {k: v for k, v in record.items() if k != "prompt"}


@pytest.fixture
def datasets(tmp_path, monkeypatch):
    """`datasets`, caching under tmp_path and offline (a Hub lookup here would retry for ~25 s)."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return datasets


def write(path: Path, text: str | bytes) -> str:
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


def refused(source, *, text_field="prompt", split="train") -> str:
    with pytest.raises(PromptDataError) as e:
        load_prompts(source, text_field, split)
    message = str(e.value)
    assert "\n" not in message
    return message


# --- formats -------------------------------------------------------------------------------------- #

def test_txt_is_one_prompt_per_line_stripped_and_trailing_blank_lines_are_fine(tmp_path):
    src = write(tmp_path / "p.txt", 'A sign that reads "OPEN"  \n\t a red car\r\n\n  \n')
    assert load_prompts(src) == [DataPrompt('A sign that reads "OPEN"', {}), DataPrompt("a red car", {})]


def test_jsonl_keeps_geneval_metadata_exactly(tmp_path):
    src = write(tmp_path / "m.jsonl", "".join(json.dumps(r) + "\n" for r in GENEVAL))
    prompts = load_prompts(src)
    assert [p.text for p in prompts] == [r["prompt"] for r in GENEVAL]
    assert [p.metadata for p in prompts] == [without_prompt(r) for r in GENEVAL]
    assert "color" not in prompts[0].metadata["include"][0]  # no None keys from schema unification


def test_json_is_json_lines_or_one_array_and_text_field_is_configurable(tmp_path):
    records = [{"caption": " two dogs ", "id": 1}, {"caption": "a cat", "id": 2, "extra": {"a": [1, None]}}]
    lines = write(tmp_path / "lines.json", "\n".join(map(json.dumps, records)))
    array = write(tmp_path / "array.json", json.dumps(records, indent=2))
    expected = [DataPrompt("two dogs", {"id": 1}), DataPrompt("a cat", {"id": 2, "extra": {"a": [1, None]}})]
    assert load_prompts(lines, "caption") == expected
    assert load_prompts(array, "caption") == expected


def test_utf8_text_and_a_byte_order_mark_are_read(tmp_path):
    src = write(tmp_path / "p.jsonl", b'\xef\xbb\xbf{"prompt": "caf\xc3\xa9 \xe2\x80\x9cOUVERT\xe2\x80\x9d"}\n')
    assert load_prompts(src) == [DataPrompt("café “OUVERT”", {})]


def test_csv_and_parquet_through_datasets(tmp_path, datasets):
    ds = datasets.Dataset.from_list([{"prompt": "a red car ", "tag": "colors", "n": 1},
                                     {"prompt": "two dogs", "tag": "counting", "n": 2}])
    ds.to_parquet(str(tmp_path / "p.parquet"))
    ds.to_csv(str(tmp_path / "p.csv"), index=False)
    expected = [DataPrompt("a red car", {"tag": "colors", "n": 1}), DataPrompt("two dogs", {"tag": "counting", "n": 2})]
    assert load_prompts(str(tmp_path / "p.parquet")) == expected
    assert load_prompts(str(tmp_path / "p.csv")) == expected


def test_save_to_disk_folders_dataset_and_dataset_dict(tmp_path, datasets):
    ds = datasets.Dataset.from_list([{"prompt": "a zebra", "include": [{"class": "zebra", "count": 1}]}])
    ds.save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict(train=ds, test=ds.map(lambda r: {"prompt": "a kite"})).save_to_disk(str(tmp_path / "dict"))
    zebra = DataPrompt("a zebra", {"include": [{"class": "zebra", "count": 1}]})
    assert load_prompts(str(tmp_path / "one")) == [zebra]
    assert load_prompts(str(tmp_path / "dict")) == [zebra]
    assert load_prompts(str(tmp_path / "dict"), split="test")[0].text == "a kite"
    assert refused(str(tmp_path / "dict"), split="validation") == \
        f"{tmp_path / 'dict'}: no split 'validation'; the saved dataset has train, test"


def test_a_local_dataset_folder_loads_like_a_dataset_id(tmp_path, datasets):
    repo = tmp_path / "repo"
    repo.mkdir()
    write(repo / "train.jsonl", '{"prompt": "a bench", "tag": "single_object"}\n{"prompt": "a cup", "tag": "x"}\n')
    assert load_prompts(str(repo)) == [DataPrompt("a bench", {"tag": "single_object"}), DataPrompt("a cup", {"tag": "x"})]
    message = refused(str(repo), split="test")
    assert message.startswith(f"{repo}: loading the folder as a dataset failed: ValueError: Unknown split")


def test_an_unreachable_dataset_id_is_one_line_naming_it_and_the_cause(datasets):
    message = refused("nobody/no-such-prompts")
    assert message.startswith("nobody/no-such-prompts: not a local path, and loading it as a Hugging Face "
                              "dataset failed: ConnectionError:")
    assert "OfflineModeIsEnabled" in message


def test_missing_datasets_package_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    assert "pip install 'jointrl[data]'" in refused(write(tmp_path / "p.csv", "prompt\na\n"))


# --- bad input ------------------------------------------------------------------------------------ #

@pytest.mark.parametrize("name, content, expected", [
    ("p.txt", "", "p.txt: no prompts"),
    ("p.txt", "\n \n", "p.txt: no prompts"),
    ("p.txt", "a cat\n   \na dog\n", "p.txt, line 2: the prompt is empty"),
    ("p.jsonl", '{"prompt": "a"}\n{"prompt": "b",}\n', "p.jsonl, line 2: not JSON (Expecting property name "
                                                       "enclosed in double quotes, column 16)"),
    ("p.jsonl", '{"prompt": "a"}\n\n{"prompt": "b"}\n', "p.jsonl, line 2: blank line; expected one JSON object "
                                                        "per line"),
    ("p.jsonl", '{"prompt": "a"}\n["b"]\n', "p.jsonl, line 2: the record is an array, not an object"),
    ("p.jsonl", '{"prompt": "a"}\n{"text": "b", "tag": "x"}\n', "p.jsonl, line 2: no 'prompt' field "
                                                                "(task.text_field); the record's fields: 'text', 'tag'"),
    ("p.jsonl", '{}\n', "p.jsonl, line 1: no 'prompt' field (task.text_field); the record's fields: none"),
    ("p.jsonl", '{"prompt": " \\t "}\n', "p.jsonl, line 1: the prompt is empty"),
    ("p.jsonl", '{"prompt": "a"}\n{"prompt": 3}\n', "p.jsonl, line 2: 'prompt' is a number, not a string"),
    ("p.jsonl", '{"prompt": ["a"]}\n', "p.jsonl, line 1: 'prompt' is an array, not a string"),
    ("p.json", '[{"prompt": "a"},\n "b"]', "p.json, item 2 of the array: the record is a string, not an object"),
    ("p.json", '[{"prompt": "a"},\n {"prompt": }]', "p.json, line 2: not JSON (Expecting value, column 13)"),
    ("p.txt", b"a cat\na dog\nna\xefve\n", "p.txt, line 3: not UTF-8 text (byte 0xef)"),
    ("p.jsonl", b'{"prompt": "a"}\n{"prompt": "\xff"}\n', "p.jsonl, line 2: not UTF-8 text (byte 0xff)"),
    ("p.yaml", "- a cat\n", "p.yaml: unknown prompt file type '.yaml'; expected one of .txt, .jsonl, .json, .csv, "
                            ".parquet, a saved dataset folder or a dataset id"),
])
def test_bad_files_are_refused_naming_the_line(tmp_path, name, content, expected):
    assert refused(write(tmp_path / name, content)) == f"{tmp_path}/{expected}"


@pytest.mark.parametrize("content, expected", [
    ("prompt,tag\na cat,x\n,y\n", "row 2 (line 3): the prompt is empty"),
    ("prompt,tag\na cat,x\n  ,y\n", "row 2 (line 3): the prompt is empty"),
    ("caption,tag\na cat,x\n", "row 1 (line 2): no 'prompt' field (task.text_field); the record's fields: "
                               "'caption', 'tag'"),
    ("prompt,tag\n1,x\n2,y\n", "row 1 (line 2): 'prompt' is a number, not a string"),
    (b"prompt\na cat\n\xff\n", "line 3: not UTF-8 text (byte 0xff)"),
])
def test_bad_csv_is_refused_naming_row_and_line(tmp_path, datasets, content, expected):
    src = write(tmp_path / "p.csv", content)
    assert refused(src) == f"{src}, {expected}"


def test_bad_parquet_row_is_named(tmp_path, datasets):
    src = str(tmp_path / "p.parquet")
    datasets.Dataset.from_list([{"prompt": "a cat"}, {"prompt": "b"}, {"prompt": ""}]).to_parquet(src)
    assert refused(src) == f"{src}, row 3: the prompt is empty"


def test_tables_without_rows_have_no_prompts(tmp_path, datasets):
    for content in ("", "prompt,tag\n", "prompt\n\n"):
        assert refused(write(tmp_path / "p.csv", content)) == f"{tmp_path}/p.csv: no prompts"
    datasets.Dataset.from_dict({"prompt": []}).to_parquet(str(tmp_path / "p.parquet"))
    assert refused(str(tmp_path / "p.parquet")) == f"{tmp_path}/p.parquet: no prompts"


@pytest.mark.parametrize("source", ["missing.jsonl", "data/prompts/train", "./train", "/no/such/dir", "~/nope.txt"])
def test_a_missing_path_is_reported_missing_not_looked_up(source):
    assert refused(source) == f"{source}: no such file or folder"


# --- overlap and the shipped sets ----------------------------------------------------------------- #

def test_prompt_key_and_overlap():
    assert prompt_key("A photo of a dog.") == prompt_key("a photo of a  dog") == "a photo of a dog"
    assert prompt_key("  Two   CATS?! ") == "two cats"
    train = [DataPrompt("A photo of a dog.", {}), DataPrompt("a red car", {})]
    evals = [DataPrompt(t, {}) for t in ("a photo of a  dog", "a cat", "A RED CAR!", "a photo of a  dog")]
    assert overlap(train, evals) == ["a photo of a  dog", "A RED CAR!"]
    assert overlap(train, [DataPrompt("a cat", {})]) == []


GENEVAL_TAGS = {"single_object", "two_object", "counting", "colors", "position", "color_attr"}


@pytest.mark.parametrize("kind", ["geneval", "ocr"])
def test_shipped_tiny_sets_load_and_train_and_eval_are_disjoint(kind):
    suffix = "jsonl" if kind == "geneval" else "txt"
    train = load_prompts(str(DATA / f"{kind}-tiny-train.{suffix}"))
    evals = load_prompts(str(DATA / f"{kind}-tiny-eval.{suffix}"))
    assert overlap(train, evals) == [] and len(train) > len(evals) >= 8
    if kind == "ocr":
        assert all(p.text.count('"') == 2 and not p.metadata for p in train + evals)
        return
    for prompts in (train, evals):
        assert {p.metadata["tag"] for p in prompts} == GENEVAL_TAGS
    for p in train + evals:
        include = p.metadata["include"]
        assert set(p.metadata) <= {"tag", "include", "exclude"} and all(c["count"] >= 1 for c in include)
        if p.metadata["tag"] == "counting":
            assert p.metadata["exclude"] == [{"class": include[0]["class"], "count": include[0]["count"] + 1}]
        if p.metadata["tag"] == "position":
            assert include[1]["position"][1] == 0 and include[1]["position"][0] in ("left of", "right of", "above",
                                                                                     "below")
