"""Pure scoring of long-context evaluations (numpy): per-token model outputs -> the reported figures.

Every suite reads the same two arrays per row, what a scorer (scorer.py, or a stub
in tests) returns for tokens_BxT1: `nll_BxT`, the next-token negative
log-likelihood of each target tokens[:, 1:], and `hit_BxT`, whether the model's
greedy (argmax) prediction equals that target. From them:

  - answer scores: log-probability of an answer span (-sum of its nll) and exact
    match (every answer target hit: teacher-forced greedy = what greedy decoding emits);
  - loss by position: mean nll per log-spaced bucket of target positions
    [0, 1), [1, 2), [2, 4), ..., [2^k, L);
  - kv_recall by distance: accuracy of the answers per log-spaced bucket of the
    distance from the queried pair's key to the query's key;
  - text loss: the mean nll and perplexity of the first window of a text and of all its windows.
"""

from __future__ import annotations

import numpy as np


def log2_edges(n: int) -> list[int]:
    """[0, 1, 2, 4, ..., n]: bucket edges covering [0, n), the last bucket ends at n."""
    if n < 1:
        raise ValueError(f"log2_edges needs n >= 1, got {n}")
    edges = [0, 1]
    while edges[-1] * 2 < n:
        edges.append(edges[-1] * 2)
    return edges + [n] if edges[-1] < n else edges


def answer_scores(nll_BxT: np.ndarray, hit_BxT: np.ndarray, answer_BxT: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(log-probability of each row's answer [B], exact match of each row [B] bool)."""
    answer_BxT = np.asarray(answer_BxT, bool)
    if not answer_BxT.any(axis=1).all():
        raise ValueError("every row needs at least one answer target")
    logprob_B = -(np.asarray(nll_BxT, np.float64) * answer_BxT).sum(axis=1)
    exact_B = (np.asarray(hit_BxT, bool) | ~answer_BxT).all(axis=1)
    return logprob_B, exact_B


def bucket_means(values_N: np.ndarray, keys_N: np.ndarray, edges: list[int]) -> tuple[list[float | None], list[int]]:
    """Mean of `values_N` per bucket [edges[i], edges[i+1]) of `keys_N`, and the counts (None where empty)."""
    values_N, keys_N = np.asarray(values_N, np.float64).ravel(), np.asarray(keys_N).ravel()
    idx_N = np.searchsorted(np.asarray(edges), keys_N, side="right") - 1
    means, counts = [], []
    for i in range(len(edges) - 1):
        sel = idx_N == i
        counts.append(int(sel.sum()))
        means.append(float(values_N[sel].mean()) if sel.any() else None)
    return means, counts


def loss_by_position(nll_NxT: np.ndarray) -> dict:
    """{'edges', 'loss', 'tokens'}: mean nll of the rows per log-spaced bucket of target positions."""
    nll_NxT = np.asarray(nll_NxT, np.float64)
    T = nll_NxT.shape[1]
    edges = log2_edges(T)
    pos_NxT = np.broadcast_to(np.arange(T), nll_NxT.shape)
    loss, tokens = bucket_means(nll_NxT, pos_NxT, edges)
    return {"edges": edges, "loss": loss, "tokens": tokens, "mean": float(nll_NxT.mean())}


def kv_by_distance(hit_BxT: np.ndarray, pair_key_pos_BxQ: np.ndarray, query_key_pos_BxQ: np.ndarray, T: int) -> dict:
    """{'edges', 'accuracy', 'answers', 'mean'}: kv_recall accuracy per log-spaced query - pair distance.

    The answer of a query is the target at its key's position (the value follows the key).
    """
    rows_Bx1 = np.arange(len(hit_BxT))[:, None]
    correct_BxQ = np.asarray(hit_BxT, bool)[rows_Bx1, query_key_pos_BxQ]
    dist_BxQ = np.asarray(query_key_pos_BxQ) - np.asarray(pair_key_pos_BxQ)
    edges = log2_edges(T)
    acc, n = bucket_means(correct_BxQ, dist_BxQ, edges)
    # Only the buckets that hold answers: kv_recall never puts a pair within the window of its query.
    keep = [i for i, c in enumerate(n) if c]
    return {
        "edges": [[edges[i], edges[i + 1]] for i in keep],
        "accuracy": [acc[i] for i in keep],
        "answers": [n[i] for i in keep],
        "mean": float(correct_BxQ.mean()),
    }


def _loss_ppl(nll: np.ndarray) -> dict:
    loss = float(np.mean(nll))
    return {"loss": loss, "ppl": float(np.exp(loss))}


def text_loss(nll_WxT: np.ndarray) -> dict:
    """{'first': {'loss', 'ppl'}, 'windows': {'loss', 'ppl', 'count'}, 'by_position'} of the nll of W
    windows of a text, in order.

    Window w's row holds the predictions of its tokens 1..T (each from the tokens before it in the
    window). 'first': the mean over window 0's; 'windows': the mean over every prediction of every
    window (the windows are equally long, so also the mean of their means), and W. ppl = exp(loss).
    'by_position': loss_by_position over the windows (how the loss falls with the context a
    prediction had).
    """
    nll_WxT = np.asarray(nll_WxT, np.float64)
    if nll_WxT.ndim != 2 or nll_WxT.size == 0:
        raise ValueError(f"text_loss needs [windows, predictions] with at least one of each, got {nll_WxT.shape}")
    windows = {**_loss_ppl(nll_WxT), "count": len(nll_WxT)}
    return {"first": _loss_ppl(nll_WxT[0]), "windows": windows, "by_position": loss_by_position(nll_WxT)}
