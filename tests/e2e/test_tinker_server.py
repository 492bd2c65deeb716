"""A real `infer serve` process on the default model, driven by the stock tinker SDK:
LoRA fine-tuning teaches it a fact it cannot know, the trained adapter answers with it
through the serving engine (beside base-model requests on the OpenAI API), and the
checkpoints outlive the server."""

import os
from contextlib import AbstractContextManager
from pathlib import Path

import openai
import pytest
import tinker
from tinker import types

from tests.e2e.server import infer_serve

pytestmark = pytest.mark.slow
os.environ.setdefault("TINKER_TELEMETRY", "0")
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
KEY = "tml-e2e"
QUESTION = [{"role": "user", "content": "What is the secret word?"}]
ANSWER = {"role": "assistant", "content": "The secret word is pineapple."}


def server(checkpoints: Path) -> AbstractContextManager[str]:
    return infer_serve("--checkpoint-dir", str(checkpoints))


def chat_tokens(tokenizer, messages, *, prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
    return list(tokenizer.encode(text, add_special_tokens=False))


def answer(sampler: tinker.SamplingClient, tokenizer, prompt: list[int]) -> str:
    params = types.SamplingParams(max_tokens=16, temperature=0.0)
    out = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result()
    return str(tokenizer.decode(out.sequences[0].tokens))


def test_fine_tune_sample_and_resume_after_a_restart(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    with server(checkpoints) as url:
        sc = tinker.ServiceClient(base_url=url, api_key=KEY)
        caps = tinker.RestClient(base_url=url, api_key=KEY).get_server_capabilities().result()
        models = [m.model_name for m in caps.supported_models]
        assert models == [MODEL]  # no borrowed names unless --tinker-alias asks
        tc = sc.create_lora_training_client(base_model=MODEL, rank=16, seed=0).result()
        tokenizer = tc.get_tokenizer()  # from the served model's folder: offline
        prompt = chat_tokens(tokenizer, QUESTION, prompt=True)
        full = chat_tokens(tokenizer, [*QUESTION, ANSWER], prompt=False)
        weights = [0.0] * (len(prompt) - 1) + [1.0] * (len(full) - len(prompt))
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(full[:-1]),
            loss_fn_inputs={"target_tokens": full[1:], "weights": weights},
        )
        base = sc.create_sampling_client(base_model=MODEL).result()
        assert "pineapple" not in answer(base, tokenizer, prompt).lower()

        losses = []
        for _ in range(8):
            fb = tc.forward_backward([datum], "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            losses.append(fb.result().metrics["loss:sum"])
        assert losses[-1] < 0.1 * losses[0], losses
        state = tc.save_state("taught").result().path
        sampler_path = tc.save_weights_for_sampler("taught").result().path
        trained = sc.create_sampling_client(model_path=sampler_path).result()
        assert "pineapple" in answer(trained, tokenizer, prompt).lower()
        # The OpenAI face still serves the base model, alongside.
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        reply = oa.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            temperature=0,
            max_tokens=16,  # type: ignore[arg-type]
        )
        assert "pineapple" not in (reply.choices[0].message.content or "").lower()
        scored = trained.compute_logprobs(types.ModelInput.from_ints(full)).result()
        sc.close("success").result()

    with server(checkpoints) as url:  # a new process: the checkpoints are still there
        rest = tinker.RestClient(base_url=url, api_key=KEY)
        paths = {c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints}
        assert paths == {state, sampler_path}
        sc = tinker.ServiceClient(base_url=url, api_key=KEY)
        again = sc.create_sampling_client(model_path=sampler_path).result()
        assert "pineapple" in answer(again, tokenizer, prompt).lower()
        again_scored = again.compute_logprobs(types.ModelInput.from_ints(full)).result()
        assert again_scored[0] is None and scored[0] is None
        assert again_scored[1:] == pytest.approx(scored[1:], abs=1e-3)
        resumed = sc.create_training_client_from_state_with_optimizer(state).result()
        out = resumed.forward([datum], "cross_entropy").result()
        assert out.metrics["loss:sum"] == pytest.approx(losses[-1], abs=0.5)
        sc.close("success").result()
