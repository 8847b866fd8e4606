"""Judge Q training (JudgeQ-trainable-queries.txt; docs/METHODS.md "Judge Q"): soft-token embeddings whose
attention to the prompt imitates the attention of the model's own response.

    import kvpress_c
    from kvpress_c import judgeq
    model = kvpress_c.load_model()
    data = judgeq.build_dataset(model, judgeq.stdlib_corpus("train")[:200])
    result = judgeq.train(model, data, n_soft=32, lr=1e-2, epochs=3, batch_size=16, out="runs/jq")
    press = kvpress_c.JudgeQPress(soft_embeddings=result.soft_embeddings, budget=128)

The loss and its gradient are computed in C (`kvc_judgeq_loss_grad`, csrc/train/judgeq_grad.c): for a
(prompt, response) pair, A_resp[l, h, j] is the mean over the response tokens of their causal softmax
attention read at prompt position j (not renormalised), A_soft the same for the soft tokens appended
after the prompt (positions len(prompt) ..., as JudgeQPress runs them), and the loss is the mean of
(A_soft - A_resp)^2 over layers, query heads and prompt positions. This module only drives it:
data building, AdamW in NumPy, validation, checkpoints that resume exactly, a loss curve.

The package: gradient.py (the C loss and gradient), data.py (samples), training.py (the loop), report.py
(curve, hit rates).
"""
from .data import Sample, build_dataset, load_dataset, save_dataset, stdlib_corpus
from .gradient import Pair, attention_maps, init_soft, loss_and_grad, loss_only, token_embeddings
from .report import hit_rates, kept_indices, plot_history
from .training import BEST, CHECKPOINT, CURVE, FINAL, HISTORY, AdamW, TrainResult, evaluate, train

__all__ = ["Pair", "loss_and_grad", "loss_only", "attention_maps", "token_embeddings", "init_soft", "Sample",
           "stdlib_corpus", "build_dataset", "save_dataset", "load_dataset", "AdamW", "TrainResult", "evaluate",
           "train", "plot_history", "kept_indices", "hit_rates", "CHECKPOINT", "FINAL", "BEST", "HISTORY", "CURVE"]
