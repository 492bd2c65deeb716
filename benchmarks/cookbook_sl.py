"""tinker-cookbook's supervised training loop, unmodified, against a running `infer serve`.

Not part of the project's dependencies (the cookbook pulls datasets, pyarrow, pandas, ...):
`make setup` installs it, pinned, into ``.cookbook/`` beside the project (the Makefile's
``COOKBOOK_PACKAGES`` say why without dependency resolution). Run:

    .venv/bin/infer serve --port 8000 &
    TINKER_API_KEY=tml-cookbook PYTHONPATH=.cookbook .venv/bin/python benchmarks/cookbook_sl.py \\
        [--base-url http://127.0.0.1:8000] [--log-path /tmp/cookbook_sl]

It trains a LoRA adapter (rank 16, one epoch, batch 16, lr 5e-4) on the cookbook's own
offline dataset (``example_data/conversations.jsonl``, 128 chats, 16 held out) with
``tinker_cookbook.supervised.train.main``: the model is named by its own served name, its
renderer chosen explicitly (``qwen3_instruct``: ChatML, SmolLM2's chat format; the cookbook
knows no SmolLM2, so it would not pick one itself); the only thing registered from outside
is the tokenizer — the served model's own files, so nothing is downloaded. The cookbook
logs train NLL, test NLL every 4 steps, and saves state + sampler checkpoints at the end
(``tinker://`` paths).
"""

import argparse
import asyncio
import os
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")
RENDERER = "qwen3_instruct"  # ChatML, as SmolLM2 writes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--log-path", default="/tmp/cookbook_sl")
    args = parser.parse_args()

    import tinker_cookbook
    from tinker_cookbook import tokenizer_utils
    from tinker_cookbook.renderers import TrainOnWhat
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
    from transformers import AutoTokenizer

    from adapters.weights.factory import resolve

    served = resolve(None, None, progress=True)  # the default model's converted folder
    model = served.name
    tokenizer_utils.register_tokenizer(model, lambda: AutoTokenizer.from_pretrained(served.path))
    data = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=model,
        renderer_name=RENDERER,
        max_length=512,
        batch_size=16,
        train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES,
    )
    config = train.Config(
        log_path=args.log_path,
        recipe_name="infer_cookbook_sl",
        model_name=model,
        renderer_name=RENDERER,
        dataset_builder=FromConversationFileBuilder(
            common_config=common, file_path=str(data), test_size=16
        ),
        learning_rate=5e-4,
        num_epochs=1,
        lora_rank=16,
        base_url=args.base_url,
        eval_every=4,
        save_every=4,
    )
    asyncio.run(train.main(config))


if __name__ == "__main__":
    main()
