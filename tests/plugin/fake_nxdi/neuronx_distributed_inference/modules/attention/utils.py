"""modules/attention/utils.py: repeat_kv and manual_softmax as NxDI defines them (the
same in 0.7-0.9; read in ef2731e)."""

import torch


def repeat_kv(hidden_states, n_rep):
    """[batch, kv_heads, seq, dim] -> [batch, kv_heads * n_rep, seq, dim]."""
    if n_rep == 1:
        return hidden_states
    batch, kv_heads, seq, dim = hidden_states.shape
    expanded = hidden_states[:, :, None, :, :].expand(batch, kv_heads, n_rep, seq, dim)
    return expanded.reshape(batch, kv_heads * n_rep, seq, dim)


def manual_softmax(prior_scores, active_scores, is_speculation):
    """One softmax over the prior and active scores together, returned as two parts;
    the maximum is taken over both when is_speculation (prefix prefill passes True)."""
    max_score = torch.max(prior_scores, dim=-1, keepdim=True)[0]
    max_active = torch.max(active_scores, dim=-1, keepdim=True)[0]
    max_score = (torch.maximum(max_score, max_active) if is_speculation
                 else torch.maximum(max_score, active_scores))
    exp_prior = torch.exp(prior_scores - max_score)
    exp_active = torch.exp(active_scores - max_score)
    denominator = exp_prior.sum(dim=-1, keepdim=True) + exp_active.sum(dim=-1, keepdim=True)
    return exp_prior / denominator, exp_active / denominator
