# What the Hugging Face snippets take for granted: a tiny GPT-2, a token dataset and training
# arguments for a short CPU run (20 steps, a checkpoint every 10) into ./out.
import os

import torch
import transformers

transformers.logging.set_verbosity_error()
_cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=16)
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(_cfg)
_ids = torch.randint(0, 64, (48, 16), generator=torch.Generator().manual_seed(0))
ds = [{"input_ids": r, "labels": r} for r in _ids]
args = transformers.TrainingArguments(
    output_dir="out",
    max_steps=20,
    save_steps=10,
    per_device_train_batch_size=4,
    ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,  # under torchrun: DDP over gloo
    use_cpu=True,
    report_to=[],
    logging_steps=100,
)
