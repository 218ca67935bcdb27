"""A GPT-2-small-shaped decoder (torch only, no download) and one training step of it, for the benchmarks that
train one: bench/profile_latency.py and bench/memory_history.py. (No command line: other scripts use it.)"""

from __future__ import annotations

#: GPT-2 small: 12 layers, d_model 768, 12 heads, vocabulary 50257.
GPT2 = {"layers": 12, "d_model": 768, "heads": 12, "vocab": 50257}


def decoder(shape: dict, device: str):
    """The model (embedding, pre-norm transformer layers, untied head) on `device`, seeded."""
    import torch

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        shape["d_model"], shape["heads"], 4 * shape["d_model"], dropout=0.0, batch_first=True, norm_first=True
    )
    return torch.nn.Sequential(
        torch.nn.Embedding(shape["vocab"], shape["d_model"]),
        torch.nn.TransformerEncoder(layer, shape["layers"]),
        torch.nn.Linear(shape["d_model"], shape["vocab"], bias=False),
    ).to(device)


def train_step(model, opt, tokens, device: str, autocast: bool) -> None:
    """One next-token step: forward (bf16 autocast when asked), cross-entropy, backward, optimizer step."""
    import torch

    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
