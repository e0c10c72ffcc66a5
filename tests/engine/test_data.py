"""Reading prompts: strings and TRL conversations from .txt, .jsonl, parquet, csv, json, saved datasets, hub ids."""

import json

import pytest

from ppo_cli.engine.data import PromptSampler, check_reward_reads_conversations, read_prompts
from ppo_cli.errors import DataError
from ppo_cli.recipe import RewardConfig

SYSTEM = {"role": "system", "content": "be brief"}
USER = {"role": "user", "content": "the dog?"}
ANSWER = {"role": "assistant", "content": "a dog."}
CONVERSATIONS = [[SYSTEM, USER], [{"role": "user", "content": "and the fox?"}]]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _dataset(rows):
    import datasets

    return datasets.Dataset.from_list(rows)


def test_jsonl_strings_and_conversations_in_the_prompt_field(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "plain"}, {"prompt": [SYSTEM, USER]}])
    assert read_prompts(path).prompts == ["plain", [SYSTEM, USER]]


def test_messages_column_drops_the_trailing_assistant_answer(tmp_path):
    path = _jsonl(tmp_path / "m.jsonl", [{"messages": [SYSTEM, USER, ANSWER]}, {"messages": [USER]}])
    assert read_prompts(path).prompts == [[SYSTEM, USER], [USER]]


def test_prompt_column_ending_with_an_assistant_turn_is_an_error(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": [USER, ANSWER]}])
    with pytest.raises(DataError, match=f"^{path}:1: 'prompt' ends with an assistant message; "):
        read_prompts(path)


@pytest.mark.parametrize("suffix", ["parquet", "json", "saved"])
def test_dataset_files_read_back_the_same_conversations(tmp_path, suffix):
    rows = [{"messages": [*c, ANSWER]} for c in CONVERSATIONS]
    dataset = _dataset(rows)
    path = tmp_path / f"data.{suffix}"
    if suffix == "parquet":
        dataset.to_parquet(str(path))
    elif suffix == "json":
        path.write_text(json.dumps(rows))
    else:
        dataset.save_to_disk(str(path))
    assert read_prompts(path).prompts == CONVERSATIONS


def test_csv_with_a_named_column(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text('id,question\n1,"the dog, again?"\n2,the fox?\n')
    assert read_prompts(path, "question").prompts == ["the dog, again?", "the fox?"]


def test_saved_dataset_dict_reads_the_asked_split_and_lists_the_others(tmp_path):
    import datasets

    splits = datasets.DatasetDict({"train": _dataset([{"prompt": "a"}]), "test": _dataset([{"prompt": "b"}])})
    splits.save_to_disk(str(tmp_path / "dd"))
    assert read_prompts(tmp_path / "dd", split="test").prompts == ["b"]
    with pytest.raises(DataError) as err:
        read_prompts(tmp_path / "dd", split="validation")
    assert str(err.value) == f"{tmp_path / 'dd'}: no split 'validation' (splits: train, test)"


def test_unknown_column_lists_the_columns(tmp_path):
    path = tmp_path / "p.parquet"
    _dataset([{"question": "a", "id": 1}]).to_parquet(str(path))
    with pytest.raises(DataError) as err:
        read_prompts(path)
    assert str(err.value) == f"{path}: no 'prompt' or 'messages' column (columns: question, id)"
    with pytest.raises(DataError) as err:
        read_prompts(path, "text")
    assert str(err.value) == f"{path}: no 'text' column (columns: question, id)"


def test_a_misspelt_field_gets_the_close_column_as_its_hint(tmp_path):
    path = _jsonl(tmp_path / "gsm.jsonl", [{"question": "What is 2 + 3?", "answer": "#### 5"}])
    with pytest.raises(DataError) as err:
        read_prompts(path, "questions")
    assert err.value.message == f"{path}:1: no 'questions' field (fields: answer, question)"
    assert err.value.hint == "did you mean data.field: question (or --field question)?"
    with pytest.raises(DataError) as err:  # nothing close: the general hint
        read_prompts(path, "xyz")
    assert err.value.hint == "name the prompt column with data.field in the recipe (or --field)"


def test_bad_conversation_row_names_its_line_or_row(tmp_path):
    bad = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    path = _jsonl(tmp_path / "p.jsonl", [{"messages": [USER]}, {"messages": bad}])
    with pytest.raises(DataError) as err:
        read_prompts(path)
    assert str(err.value) == f"{path}:2: 'messages' message 0: 'content' must be a string, got list"

    parquet = tmp_path / "p.parquet"
    _dataset([{"prompt": [USER]}, {"prompt": [{"role": "user", "text": "hi"}]}]).to_parquet(str(parquet))
    with pytest.raises(DataError) as err:
        read_prompts(parquet)
    # parquet gives every message every key of the column's struct: 'content' is there, as null
    assert str(err.value) == f"{parquet}: row 1: 'prompt' message 0: no 'content' (keys: role, text)"


@pytest.mark.parametrize("value, problem", [
    (7, "'prompt' must be a string or a list of {role, content} messages, got int"),
    (["hi"], "'prompt' message 0: expected a {role, content} object, got str"),
    ([{"content": "hi"}], "'prompt' message 0: no 'role' (keys: content)"),
    ([SYSTEM], "'prompt' has no user message"),
])
def test_malformed_conversation_rows(tmp_path, value, problem):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": value}])
    with pytest.raises(DataError) as err:
        read_prompts(path)
    assert str(err.value) == f"{path}:1: {problem}"


def test_a_string_in_a_messages_column_is_refused_not_read_as_plain_text(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"messages": [USER]}, {"messages": "Why is the sky blue?"}])
    with pytest.raises(DataError) as err:
        read_prompts(path)
    assert str(err.value) == f"{path}:2: 'messages' must be a list of {{role, content}} messages, got a string"
    assert "'prompt' column" in err.value.hint
    plain = _jsonl(tmp_path / "q.jsonl", [{"prompt": "Why is the sky blue?"}])  # the same text as a prompt: read
    assert read_prompts(plain).prompts == ["Why is the sky blue?"]


def test_hub_id_with_the_hub_offline_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))  # an empty cache: nothing to fall back on
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as err:
        read_prompts("someorg/no-such-prompts", split="train")
    assert str(err.value) == (
        "dataset 'someorg/no-such-prompts' is not a local file and the hub is offline (HF_HUB_OFFLINE=1), "
        "and it is not in the datasets cache"
    )
    assert "unset HF_HUB_OFFLINE" in err.value.hint


def test_missing_local_file_is_not_taken_for_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match="^prompts file not found: data/prompts.parquet$"):
        read_prompts("data/prompts.parquet")


def test_sampler_serves_conversations_and_resumes_at_its_position():
    prompts = ["a", [USER], "b", [SYSTEM, USER]]
    sampler = PromptSampler(prompts, seed=3)
    first = sampler.next_batch(3)
    assert sampler.state_dict() == {"epoch": 0, "position": 3}  # the checkpoint format of string prompts
    resumed = PromptSampler(prompts, seed=3)
    resumed.load_state_dict(json.loads(json.dumps(sampler.state_dict())))
    rest = sampler.next_batch(5)
    assert resumed.next_batch(5) == rest
    assert sorted(map(json.dumps, first + rest[:1])) == sorted(map(json.dumps, prompts))  # one epoch: each once


def test_prompt_and_response_reward_refuses_conversations_before_loading_anything():
    reward = RewardConfig(components=[{"type": "model", "path": "rm"}, {"type": "classifier", "path": "c", "labels": {"x": 1}}])
    check_reward_reads_conversations(reward, ["plain text"])  # strings: fine
    with pytest.raises(DataError) as err:
        check_reward_reads_conversations(reward, ["plain", [USER]])
    assert str(err.value) == "reward.components.0 (model) reads text: prompt_and_response, but the prompts are conversations"


def test_jsonl_rows_carry_their_other_fields_as_columns(tmp_path):
    from ppo_cli.engine.data import PromptColumns, read_prompts

    path = tmp_path / "math.jsonl"
    path.write_text('{"prompt": "1+1?", "answer": "2", "level": 1}\n{"prompt": "2+2?", "answer": "4"}\n')
    prompt_set = read_prompts(path)
    assert prompt_set.prompts == ["1+1?", "2+2?"]
    assert prompt_set.columns == [{"answer": "2", "level": 1}, {"answer": "4"}]
    # a rollout's prompts: repeated and reordered; a row without a column gets None there
    assert PromptColumns([prompt_set]).columns_for(["2+2?", "1+1?", "2+2?"]) == {
        "answer": ["4", "2", "4"], "level": [None, 1, None]}


@pytest.mark.parametrize("source", ["jsonl", "csv", "saved", "directory", "txt"])
def test_prompt_sets_name_their_prompt_column_and_the_columns_a_reward_can_take(tmp_path, source):
    """What validate checks a reward function's columns against, for files and datasets alike."""
    rows = [{"question": "1+1?", "answer": "2", "level": 1}, {"question": "2+2?", "answer": "4", "level": 2}]
    path = tmp_path / f"data.{source}"
    if source == "jsonl":
        _jsonl(path, rows)
    elif source == "directory":
        path.mkdir()
        _jsonl(path / "part.jsonl", rows)
    elif source == "csv":
        path.write_text("question,answer,level\n1+1?,2,1\n2+2?,4,2\n")
    elif source == "saved":
        _dataset(rows).save_to_disk(str(path))
    else:
        path.write_text("1+1?\n")
    prompt_set = read_prompts(path, None if source == "txt" else "question")
    expected = (None, set()) if source == "txt" else ("question", {"answer", "level"})
    assert (prompt_set.column, prompt_set.column_names) == expected
