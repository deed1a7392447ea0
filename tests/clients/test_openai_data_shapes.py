"""Training data in every chat shape OpenAI's fine-tuning accepts, through the official
`openai` SDK against a real `tuneq up`: function-calling records (tools, tool calls with
null content, tool results, parallel calls), weights, names, text parts, records without
a user turn and the legacy functions upload with token statistics and train to a
succeeded job; a malformed tool call is refused at upload naming its line and field.
Preference pairs (OpenAI's DPO format) upload with statistics, and DPO on them continues
the model a supervised job on the function-calling data made (SFT then DPO, as OpenAI
recommends), reporting its β and its figures; a supervised job on pairs, and a DPO job
on chats, are refused naming `method`, as is a β out of range. An OpenAI model name the
operator maps to an open model (`--model-alias`) runs unchanged."""

from __future__ import annotations

import json
import subprocess

import openai
import pytest

from conftest import REPO_ROOT, Service, tuneq_bin
from test_openai_fine_tuning import terminal, wait_for

DEMO_MODEL = "tuneq-tiny-demo"
TOOLS = (REPO_ROOT / "examples/data/openai-tools.jsonl").read_bytes()
PREFERENCE = (REPO_ROOT / "examples/data/openai-preference.jsonl").read_bytes()


def test_function_calling_data_uploads_and_trains(client):
    uploaded = client.files.create(file=("tools.jsonl", TOOLS), purpose="fine-tune")
    validation = uploaded.model_extra["validation"]
    assert validation["format"] == "chat"
    assert validation["examples"] == 10
    tokens = validation["tokens"]
    assert 0 < tokens["trained_tokens"] < tokens["tokens"], "tool results and prompts carry no loss"

    job = run_to_the_end(client, DEMO_MODEL, uploaded.id)
    assert job.status == "succeeded", job.error
    assert job.trained_tokens and job.trained_tokens > 0


def run_to_the_end(client, model: str, training_file: str):
    job = client.fine_tuning.jobs.create(
        model=model,
        training_file=training_file,
        method={"type": "supervised",
                "supervised": {"hyperparameters": {"n_epochs": 1, "batch_size": 2}}},
    )
    return wait_for(client, job.id, terminal)


def test_an_openai_model_name_runs_on_the_model_the_operator_maps_it_to(tmp_path):
    from openai import OpenAI

    alias = "gpt-4o-mini-2024-07-18"
    service = Service(tmp_path / "data", extra_args=[
        "--model-alias", f"{alias}={DEMO_MODEL}", "--model-alias", f"gpt-3.5-turbo={DEMO_MODEL}"])
    try:
        client = OpenAI(base_url=f"{service.url}/v1", api_key=service.api_key, max_retries=0)
        listed = {m.id: m for m in client.models.list()}
        assert {alias, "gpt-3.5-turbo", DEMO_MODEL} <= set(listed)
        assert listed[alias].model_extra["base_model"] == DEMO_MODEL
        assert client.models.retrieve(alias).id == alias

        uploaded = client.files.create(file=("tools.jsonl", TOOLS), purpose="fine-tune")
        job = run_to_the_end(client, alias, uploaded.id)
        assert job.status == "succeeded", job.error
        assert job.model == alias and job.model_extra["base_model"] == DEMO_MODEL
        assert job.fine_tuned_model.startswith(f"ft:{alias}:")
        assert job.fine_tuned_model in {m.id for m in client.models.list()}
    finally:
        service.stop()


def test_an_alias_of_no_registered_model_stops_the_start_naming_the_flag(tmp_path):
    started = subprocess.run(
        [str(tuneq_bin()), "up", "--port", "0", "--data-dir", str(tmp_path / "data"),
         "--model-alias", "gpt-4o=nowhere"],
        capture_output=True, text=True, timeout=60)
    assert started.returncode == 2, started.stdout + started.stderr
    assert "--model-alias gpt-4o=nowhere" in started.stderr


def test_a_malformed_tool_call_is_refused_naming_line_and_field(client):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    bad = {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "get_weather", "arguments": "{city: Paris}"}}]},
        {"role": "tool", "tool_call_id": "c9", "content": "18 C"},
        {"role": "assistant", "content": "18 C.", "weight": 3},
    ]}
    data = "\n".join(json.dumps(r) for r in (good, bad)).encode()
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("bad-tools.jsonl", data), purpose="fine-tune")
    error = caught.value.body
    assert error["code"] == "invalid_jsonl" and error["param"] == "file"
    named = {(line["line"], line["field"]) for line in error["lines"]}
    assert named >= {
        (2, "messages[1].tool_calls[0].function.arguments"),
        (2, "messages[2].tool_call_id"),
        (2, "messages[3].weight"),
    }, error["lines"]


def test_preference_pairs_upload_and_a_supervised_job_on_them_is_refused_naming_method(client):
    uploaded = client.files.create(file=("pairs.jsonl", PREFERENCE), purpose="fine-tune")
    validation = uploaded.model_extra["validation"]
    assert (validation["format"], validation["examples"]) == ("preference", 10)
    assert validation["tokens"]["trained_tokens"] > 0
    with pytest.raises(openai.BadRequestError) as caught:
        client.fine_tuning.jobs.create(model=DEMO_MODEL, training_file=uploaded.id)
    error = caught.value.body
    assert (error["code"], error["param"]) == ("method_mismatch", "method"), error
    for beta, param in ((0, "hyperparameters.beta"), (11, "hyperparameters.beta")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.fine_tuning.jobs.create(
                model=DEMO_MODEL, training_file=uploaded.id,
                method={"type": "dpo", "dpo": {"hyperparameters": {"beta": beta}}})
        assert (caught.value.body["code"], caught.value.body["param"]) == ("invalid_value", param)


def test_dpo_continues_a_supervised_model_on_preference_pairs(client):
    chats = client.files.create(file=("tools.jsonl", TOOLS), purpose="fine-tune")
    sft = run_to_the_end(client, DEMO_MODEL, chats.id)
    assert sft.status == "succeeded", sft.error

    pairs = client.files.create(file=("pairs.jsonl", PREFERENCE), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model=sft.fine_tuned_model,
        training_file=pairs.id,
        suffix="dpo",
        method={"type": "dpo",
                "dpo": {"hyperparameters": {"beta": 0.2, "n_epochs": 2, "batch_size": 2}}},
    )
    assert job.method.type == "dpo"
    assert job.method.dpo.hyperparameters.beta == 0.2
    assert job.method.dpo.hyperparameters.batch_size == 2
    assert job.method.supervised is None
    assert job.model_extra["parent_job"] == sft.id
    done = wait_for(client, job.id, terminal)
    assert done.status == "succeeded", done.error
    assert done.fine_tuned_model.startswith(f"{sft.fine_tuned_model.rsplit(':', 1)[0]}")
    assert done.fine_tuned_model in {m.id for m in client.models.list()}
    assert client.fine_tuning.jobs.retrieve(job.id).method.dpo.hyperparameters.n_epochs == 2

    metrics = [e.data for e in client.fine_tuning.jobs.list_events(job.id, limit=100)
               if e.type == "metrics"]
    assert metrics, "a DPO job reports its steps"
    figures = metrics[-1]["preference"]
    assert set(figures) >= {"rewards_chosen", "rewards_rejected", "rewards_accuracy",
                            "rewards_margin"}, figures
