"""The float64 transformers oracle of streaming eviction (runtime/core/streaming.py), shared by its
tests and bench/hostile_trial.py."""

from __future__ import annotations

_REFERENCES: dict = {}  # one reference run serves every build of the same source


def streaming_reference(folder, prompt, max_tokens, sink_tokens, recent, bs, max_model_len):
    """Greedy tokens of transformers (float64, eager attention) under the scheme's semantics: the KV token
    list restarts at each context shift (sinks + the last `recent` tokens, recomputed at positions 0..); a
    token computed after its segment's first chunk sees the sink blocks and the blocks of positions
    >= its position - recent (whole blocks), every token sees itself and what it saw when computed."""
    import torch
    from transformers import AutoModelForCausalLM

    key = (str(folder), tuple(prompt), max_tokens, sink_tokens, recent, bs, max_model_len)
    if key in _REFERENCES:
        return _REFERENCES[key]
    torch.set_num_threads(1)  # NOTE: 2 shared cores: more threads only slow these tiny matmuls down
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, attn_implementation="eager").eval()
    kv, first_chunk, out = list(prompt), len(prompt), []
    while len(out) < max_tokens:
        n = len(kv)
        visible = torch.zeros(n, n, dtype=torch.bool)
        for t in range(n):
            visible[t, :t + 1] = True
            if t >= first_chunk:
                start = max((t - recent) // bs, sink_tokens // bs) * bs  # the first kept block after the sinks
                visible[t, sink_tokens:start] = False
        mask = torch.zeros(1, 1, n, n, dtype=torch.float64).masked_fill(~visible, torch.finfo(torch.float64).min)
        with torch.no_grad():
            logits = model(torch.tensor([kv]), attention_mask=mask, position_ids=torch.arange(n)[None]).logits
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        kv.append(tok)
        if len(kv) > max_model_len:  # context shift (recent 0 keeps the sinks only)
            kv = kv[:sink_tokens] + kv[len(kv) - recent:]
            first_chunk = len(kv)
    _REFERENCES[key] = out
    return out
