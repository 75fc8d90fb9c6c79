"""Shared fixtures: the embedded model is loaded once per test session."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from ember.config import EngineConfig

torch.set_num_threads(int(os.environ.get("EMBER_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def loaded_model():
    from ember.model.loader import load_model

    return load_model(None)


@pytest.fixture(scope="session")
def make_engine(loaded_model):
    """Build an ``LLMEngine`` on the embedded model with config overrides."""
    from ember.engine.engine import LLMEngine

    def make(**overrides) -> LLMEngine:
        return LLMEngine(config=replace(EngineConfig(), **overrides), loaded=loaded_model)

    return make


@pytest.fixture(scope="module")
def int8_engine(make_engine):
    """The default engine (float32 activations, int8 weights, batch-invariant kernels): what `make serve` runs.

    One per test module: modules that step it leave its prefix cache as they like.
    """
    return make_engine(dtype="float32", quantization="int8")


@pytest.fixture(scope="session")
def fp32_engine(make_engine):
    """A float32, unquantized engine: the exact reference numerics."""
    return make_engine(dtype="float32", quantization="none")


@pytest.fixture(scope="session")
def float32_agreement_sequences(fp32_engine) -> list[tuple[list[int], list[int]]]:
    """Each of AGREEMENT_PROMPTS (chat-templated) with its 64 float32-greedy tokens: what the
    teacher-forced agreement tests feed every engine mode (computed once per session)."""
    from helpers import AGREEMENT_PROMPTS, final_tokens, greedy, run_all

    sequences = []
    for p in AGREEMENT_PROMPTS:
        ids = fp32_engine.tokenizer.encode_chat([{"role": "user", "content": p}])
        fp32_engine.add_request("teacher", ids, greedy(64, ignore_eos=True))
        sequences.append((ids, final_tokens(run_all(fp32_engine)["teacher"])))
    return sequences


@pytest.fixture(scope="session")
def hf_reference():
    """transformers' LlamaForCausalLM and tokenizer loaded from the same GGUF (test-only)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers  # a test dependency: missing means a broken setup, not a skip
    from ember.model.loader import embedded_model_path

    path = embedded_model_path()
    folder, name = os.path.split(path)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    return model, tok


@pytest.fixture(scope="session")
def ember_server():
    """One real `ember serve` on the embedded model (default options), shared by the whole session.

    Also available as ``server``; directories whose conftest defines their own
    ``server`` (tests/client's fake servers) use ``ember_server``.
    """
    from server_process import ServerProcess

    proc = ServerProcess().wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def server(ember_server):
    return ember_server
