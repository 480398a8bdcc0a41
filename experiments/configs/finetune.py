"""Fine-tune a Hugging Face checkpoint (Llama, Qwen2, Qwen3, Mixtral, Qwen3-MoE) on a corpus.

    python -m experiments.run --config experiments/configs/finetune.py:path/to/checkpoint --workdir runs/ft \
        --config.data.path=my_corpus/ [--config.optim.name=mgup_adamw] [--config.precision.recipe=ufp4]

The argument is the checkpoint's directory (`checkpoint.init_from = "hf:DIR"`): its config.json sets the model and
moe sections, its tokenizer.json (when there is one) the tokenizer, and its weights step 0's parameters (created in
their shardings). Everything else is an ordinary run: any optimizer, precision recipe, mesh or federation
(`--config.mesh.site=2`: a pretrained MoE's experts are placed over the sites by `fomoe.overlap`). Fine-tuning
defaults: a learning rate 10x below pre-training's, a short warm-up, no weight decay, held-out evaluation every 50
steps.
"""

from experiments import schema


def get_config(hf_dir: str):
    config = schema.default_config()
    config.checkpoint.init_from = "hf:" + hf_dir
    config.optim.update(learning_rate=1e-4, warmup_steps=10, weight_decay=0.0)
    config.train.update(steps=200, eval_every=50, eval_batches=8)
    config.data.update(seq_len=256, batch_size=8)
    config.sample.prompt = ""  # the model's own tokenizer may not know the default prompt's conventions
    return config
