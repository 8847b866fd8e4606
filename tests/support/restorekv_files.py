"""RestoreKV's files for tests: random restore embeddings and a random LoRA adapter in PEFT's format
(adapter_config.json + adapter_model.safetensors with base_model.model.model.layers.{i}.<module>.lora_A/B.weight),
written with NumPy (F32) or torch (BF16), or by PEFT itself (`write_with_peft`)."""
from __future__ import annotations

import json
import os

import numpy as np

MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def shapes(cfg: dict) -> dict:
    """(in, out) of each projection from a kvpress_c model config."""
    D, F = cfg["hidden"], cfg["ffn"]
    qd, kd = cfg["n_heads"] * cfg["head_dim"], cfg["n_kv_heads"] * cfg["head_dim"]
    return {"q_proj": (D, qd), "k_proj": (D, kd), "v_proj": (D, kd), "o_proj": (qd, D), "gate_proj": (D, F),
            "up_proj": (D, F), "down_proj": (F, D)}


def save(tensors: dict, path: str, dtype: str = "F32") -> None:
    if dtype == "F32":
        from safetensors.numpy import save_file
        save_file({k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()}, path)
    else:
        import torch
        from safetensors.torch import save_file
        save_file({k: torch.tensor(np.asarray(v, np.float32)).to(getattr(torch, {"BF16": "bfloat16", "F16": "float16"}[dtype]))
                   for k, v in tensors.items()}, path)


def write_restorekv(path: str, cfg: dict, rng, n_restore: int = 8, r: int = 4, alpha: float = 8.0,
                    targets=tuple(MODULES), layers=None, rslora: bool = False, dtype: str = "F32", std: float = 0.2,
                    config_extra: dict | None = None) -> dict:
    """Write the three files to the folder `path`; returns {"emb": [n, D], "lora": {(layer, module): (A, B)},
    "scale": s} as written (after rounding to dtype)."""
    os.makedirs(path, exist_ok=True)
    sh = shapes(cfg)
    lora, tensors = {}, {}
    for l in (range(cfg["n_layers"]) if layers is None else layers):
        for mod in targets:
            fan_in, fan_out = sh[mod]
            a = rng.standard_normal((r, fan_in)) * std
            b = rng.standard_normal((fan_out, r)) * std
            key = f"base_model.model.model.layers.{l}.{MODULES[mod]}.{mod}"
            tensors[key + ".lora_A.weight"], tensors[key + ".lora_B.weight"] = a, b
            lora[(l, mod)] = (a, b)
    emb = rng.standard_normal((n_restore, cfg["hidden"]))
    save(tensors, os.path.join(path, "adapter_model.safetensors"), dtype)
    save({"restore_embeddings": emb}, os.path.join(path, "restore_embeddings.safetensors"), dtype)
    conf = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "use_rslora": rslora, "target_modules": list(targets),
            "lora_dropout": 0.0, "bias": "none", "use_dora": False, "fan_in_fan_out": False, "rank_pattern": {},
            "alpha_pattern": {}, "modules_to_save": None, "task_type": "CAUSAL_LM"}
    conf.update(config_extra or {})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(conf, f)
    if dtype != "F32":  # what the files hold
        from kvpress_c.presses._tensor_files import read_safetensors
        t = read_safetensors(os.path.join(path, "adapter_model.safetensors"))
        lora = {k: (t[f"base_model.model.model.layers.{k[0]}.{MODULES[k[1]]}.{k[1]}.lora_A.weight"].astype(np.float64),
                    t[f"base_model.model.model.layers.{k[0]}.{MODULES[k[1]]}.{k[1]}.lora_B.weight"].astype(np.float64))
                for k in lora}
        emb = read_safetensors(os.path.join(path, "restore_embeddings.safetensors"))["restore_embeddings"].astype(np.float64)
    return {"emb": emb, "lora": lora, "scale": alpha / (np.sqrt(r) if rslora else r)}


def write_with_peft(path: str, hf_path: str, seed: int, n_restore: int = 8, r: int = 4, alpha: float = 8.0,
                    rslora: bool = False) -> str:
    """The adapter written by PEFT itself (get_peft_model on a fresh copy of the HF model, every lora weight drawn
    N(0, 0.2^2) in place of PEFT's zero-initialised B), and random restore embeddings."""
    import peft
    import torch
    import transformers
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora, lora_dropout=0.0, target_modules=list(MODULES))
    model = peft.get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    model.save_pretrained(path)
    save_file({"restore_embeddings": torch.randn(n_restore, base.config.hidden_size, generator=g)},
              os.path.join(path, "restore_embeddings.safetensors"))
    return path
