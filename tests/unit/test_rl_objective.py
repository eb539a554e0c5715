"""Policy-gradient objective: the issue's hand-worked normalization values, masking, advantages, pass@k."""

import math

import pytest
import torch

from raychat.config import RLConfig, from_dict
from raychat.rl.loop import NO_SIGNAL_STEPS, NoSignalWatch, no_signal_warning
from raychat.rl.objective import (
    collate,
    entropy_sum,
    group_advantages,
    normalized_loss,
    per_token_loss,
    token_logprobs,
    zero_advantage_frac,
)
from raychat.speedrun import speedrun_flags
from raychat.tasks.pass_at_k import pass_at_k


def _rows(lengths, values, T):
    loss = torch.zeros(len(lengths), T)
    mask = torch.zeros(len(lengths), T, dtype=torch.bool)
    for i, (n, v) in enumerate(zip(lengths, values)):
        loss[i, :n], mask[i, :n] = v, True
    return loss, mask


def test_token_mean_vs_sequence_mean():
    # row 0: 5 tokens of loss 2; row 1: 1 token of loss 10 -> token-mean 20/6, sequence-mean (2 + 10)/2
    loss, mask = _rows([5, 1], [2.0, 10.0], T=5)
    assert normalized_loss(loss, mask, "token", 6, 2).item() == pytest.approx(3.3333, abs=1e-4)
    assert normalized_loss(loss, mask, "sequence", 6, 2).item() == pytest.approx(6.0)


def test_advantage_normalizations_with_loss_minus_a():
    # A = +1 on a length-2 row and -1 on a length-4 row; on-policy per-token loss is -A
    logp = torch.zeros(2, 4, requires_grad=True)
    _, mask = _rows([2, 4], [0, 0], T=4)
    loss_tok, ratio = per_token_loss(logp, torch.tensor([1.0, -1.0]))
    assert torch.equal(loss_tok[0], torch.full((4,), -1.0)) and torch.equal(ratio, torch.ones(2, 4))
    assert normalized_loss(loss_tok, mask, "sequence", 6, 2).item() == pytest.approx(0.0)
    assert normalized_loss(loss_tok, mask, "token", 6, 2).item() == pytest.approx(0.3333, abs=1e-4)
    assert normalized_loss(loss_tok, mask, "constant", 6, 2, constant_length=4).item() == pytest.approx(0.25)


def test_micro_batches_sum_to_the_step_loss():
    # token-mean over the whole step: split the two rows into two micro-batches, each divided by global N=6
    loss, mask = _rows([5, 1], [2.0, 10.0], T=5)
    parts = [normalized_loss(loss[i : i + 1], mask[i : i + 1], "token", 6, 2) for i in range(2)]
    assert sum(p.item() for p in parts) == pytest.approx(20 / 6)
    parts = [normalized_loss(loss[i : i + 1], mask[i : i + 1], "sequence", 6, 2) for i in range(2)]
    assert sum(p.item() for p in parts) == pytest.approx(6.0)


def test_gradient_is_zero_at_forced_tool_output_positions():
    # tokens: prompt (mask 0) x2, sampled x2, forced tool output x2 (mask 0), sampled x1
    sample = {"tokens": [1, 2, 3, 4, 5, 6, 7], "mask": [0, 0, 1, 1, 0, 0, 1], "advantage": 0.5}
    b = collate([sample])
    assert b["loss_mask"].tolist() == [[False, True, True, False, False, True]]  # mask[1:]
    logits = torch.randn(1, 6, 11, requires_grad=True)
    logp = token_logprobs(logits, b["labels"])
    loss_tok, _ = per_token_loss(logp, b["advantages"])
    normalized_loss(loss_tok, b["loss_mask"], "token", 3, 1).backward()
    g = logits.grad[0]
    for t in (0, 3, 4):  # predicting prompt token 2 and forced tokens 5, 6
        assert torch.equal(g[t], torch.zeros(11))
    for t in (1, 2, 5):
        assert g[t].abs().sum() > 0
    # d(-A logp_y / N)/d logits = -A/N (onehot(y) - softmax): check one sampled position exactly
    p = torch.softmax(logits.detach()[0, 1], -1)
    expected = -(0.5 / 3) * (torch.nn.functional.one_hot(torch.tensor(3), 11).float() - p)
    assert torch.allclose(g[1], expected, atol=1e-6)


def test_a_huge_behavior_logprob_gap_at_a_masked_position_leaves_the_gradient_finite():
    """Asynchronous rollouts carry the behavior policy's log-prob of every label, prompt and tool-output ones
    too. At temperature 1e-3 a logit moved by 0.1 at a prompt position puts the learner 100 nats from the
    behavior there: exp overflowed to inf, and although that position's loss is masked to exactly 0, the
    backward pass multiplied 0 by inf and every gradient became NaN (the run stopped on a NaN grad norm,
    advising a lower lr). Now the ratio is 1 where loss_mask is False: the gradient is the one without the gap."""
    sample = {"tokens": [5, 1, 2, 3], "mask": [0, 0, 1, 1], "advantage": 0.5}  # label 1 is a prompt token
    b = collate([{**sample, "behavior_logprobs": [0.0] * 3}])
    torch.manual_seed(0)
    behavior_logits = torch.randn(1, 3, 8)
    T = 1e-3
    b["behavior_logprobs"] = token_logprobs(behavior_logits, b["labels"], T)
    grads = []
    for gap in (0.1, 0.0):
        logits = behavior_logits.clone()
        logits[0, 0, 1] += gap
        logits.requires_grad_(True)
        logp = token_logprobs(logits, b["labels"], T)
        loss, ratio = per_token_loss(logp, b["advantages"], b["behavior_logprobs"], loss_mask=b["loss_mask"])
        normalized_loss(loss, b["loss_mask"], "token", 2, 1).backward()
        grads.append(logits.grad)
        assert ratio.tolist() == [[1.0, 1.0, 1.0]]  # masked: 1; sampled: learner = behavior there
        if gap:  # beyond what exp can hold in fp32 (exp(88.7) is fp32's largest)
            assert abs((logp - b["behavior_logprobs"])[0, 0].item()) > 89
    assert torch.isfinite(grads[0]).all() and torch.equal(grads[0], grads[1])


def test_a_sampled_tokens_ratio_beyond_fp32_is_clipped_without_a_nan_gradient():
    """A sampled token 95 nats likelier under the learner than under the behavior policy (asynchronous rollouts
    at a low --temperature): exp overflowed to inf; with A > 0 the clipped branch's value was right, but its
    backward through exp multiplied 0 by inf and the gradient was NaN (the run stopped blaming the lr)."""
    eps = RLConfig().objective.clip_eps  # 0.2
    logp = torch.tensor([[-0.01]], requires_grad=True)
    mask = torch.tensor([[True]])
    loss, ratio = per_token_loss(logp, torch.tensor([1.0]), torch.tensor([[-95.0]]), eps, mask)
    share = normalized_loss(loss, mask, "token", 1, 1)
    share.backward()
    assert share.item() == torch.tensor(-(1 + eps)).item()  # -1.2 in float32: the clipped branch
    assert logp.grad.item() == 0.0  # the clipped branch has none
    assert ratio.item() == torch.tensor(20.0).exp().item()  # log-ratio 94.99 clamped at MAX_LOG_RATIO 20


def test_clipped_ratio():
    # behavior logprob log(0.5), current log(0.8): ratio 1.6 clipped at 1.2 for A > 0; unclipped for A < 0
    logp = torch.log(torch.tensor([[0.8]])).requires_grad_(True)
    old = torch.log(torch.tensor([[0.5]]))
    loss, ratio = per_token_loss(logp, torch.tensor([1.0]), old, clip_eps=0.2)
    assert ratio.item() == pytest.approx(1.6) and loss.item() == pytest.approx(-1.2)
    loss.sum().backward()
    assert logp.grad.item() == 0.0  # clipped: no gradient
    loss, _ = per_token_loss(logp, torch.tensor([-1.0]), old, clip_eps=0.2)
    assert loss.item() == pytest.approx(1.6)  # -min(1.6 * -1, 1.2 * -1) = 1.6


def test_group_advantages():
    assert group_advantages([1, 0, 0, 1, 1, 1], 3) == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0, 0, 0])
    # population std of [1, 0] is 0.5 -> +-1; a constant group stays 0 (eps)
    assert group_advantages([1, 0, 1, 1], 2, scale_by_std=True) == pytest.approx([1, -1, 0, 0], abs=1e-5)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages([1, 0, 1], 2)


def test_temperature_logprobs():
    logits = torch.tensor([[[2.0, 0.0]]])
    lp = token_logprobs(logits, torch.tensor([[0]]), temperature=2.0)
    assert lp.item() == pytest.approx(math.log(math.e / (math.e + 1)))


def test_entropy_of_the_sampled_tokens_by_hand():
    """verl's actor/entropy, TRL's entropy: logits (0, ln 3) are p = (1/4, 3/4), H = -(1/4 ln 1/4 + 3/4 ln 3/4)
    = 0.5623 nats; at temperature 0.5 (0, 2 ln 3): p = (1/10, 9/10), H = 0.3251; uniform logits over 5: ln 5.
    Masked tokens add nothing (the second row's first token, its huge logit not counted), nor do tokens of
    probability 0 (a -inf logit, as a banned token's)."""
    inf = float("inf")
    logits = torch.tensor([[[0.0, math.log(3), -inf, -inf, -inf], [0.0] * 5],
                           [[1e4, 0.0, 0.0, 0.0, 0.0], [0.0] * 5]])  # fmt: skip
    mask = torch.tensor([[True, True], [False, True]])
    quarter = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert entropy_sum(logits, mask).item() == pytest.approx(quarter + 2 * math.log(5), rel=1e-6)
    tenth = -(0.1 * math.log(0.1) + 0.9 * math.log(0.9))
    assert entropy_sum(logits[:1, :1], mask[:1, :1], 0.5).item() == pytest.approx(tenth, rel=1e-6)
    assert entropy_sum(logits, torch.zeros_like(mask)).item() == 0.0


def test_pass_at_k():
    assert pass_at_k(8, 0, 1) == 0.0 and pass_at_k(8, 8, 3) == 1.0
    assert pass_at_k(8, 2, 1) == pytest.approx(0.25)
    assert pass_at_k(8, 2, 2) == pytest.approx(1 - (6 * 5) / (8 * 7))  # 1 - C(6,2)/C(8,2)
    assert pass_at_k(4, 1, 4) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_bad_inputs():
    loss, mask = _rows([1], [1.0], T=1)
    with pytest.raises(ValueError, match="normalization must be one of"):
        normalized_loss(loss, mask, "mean", 1, 1)
    with pytest.raises(ValueError, match="constant_length"):
        normalized_loss(loss, mask, "constant", 1, 1)
    with pytest.raises(ValueError, match="tokens"):
        collate([{"tokens": [1, 2], "mask": [0], "advantage": 0.0}])


def test_zero_advantage_frac_is_the_share_of_groups_whose_advantages_are_all_zero():
    rewards = [0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.5, 0.5]  # G = 2: all fail, all pass, a signal, partial alike
    assert zero_advantage_frac(rewards, 2) == 0.75
    for scale in (False, True):
        adv = group_advantages(rewards, 2, scale_by_std=scale)
        assert [adv[i] == adv[i + 1] == 0 for i in range(0, 8, 2)] == [True, True, False, True]
    assert zero_advantage_frac([0.0, 1.0, 0.0, 1.0], 4) == 0.0
    with pytest.raises(ValueError, match="must be a positive multiple of group_size=2"):
        zero_advantage_frac([1.0, 0.0, 1.0], 2)


def test_the_first_steps_without_a_learning_signal_are_warned_about_once():
    """The tiny preset's RL logged reward 0 at every step and said nothing: every group's rewards were equal, so
    the policy gradient was 0. One warning line after the first NO_SIGNAL_STEPS such steps (or the whole run,
    when shorter), naming the flags to change; none when any step had a signal."""
    cfg = from_dict(RLConfig, {"samples_per_prompt": 4, "temperature": 0.7})
    silent = {"reward_mean": 0.0, "pass_at_1": 0.0, "zero_advantage_frac": 1.0}
    warnings = [no_signal_warning([silent] * n, cfg, 50) for n in range(1, NO_SIGNAL_STEPS + 3)]
    expected = (
        "warning: no learning signal in the first 5 steps: all 4 samples of every prompt failed (mean reward "
        "0), so every advantage and the policy gradient were 0; try a stronger --init-from (a checkpoint that "
        "solves some --task calculator prompts), more --samples-per-prompt (now 4) or a higher --temperature "
        "(now 0.7)"
    )
    assert warnings == [None] * (NO_SIGNAL_STEPS - 1) + [expected, None, None]
    signal = {"reward_mean": 0.125, "pass_at_1": 0.125, "zero_advantage_frac": 0.75}
    assert no_signal_warning([silent] * (NO_SIGNAL_STEPS - 1) + [signal], cfg, 50) is None
    # a run of 1 step (the tiny preset): warned after it
    assert no_signal_warning([silent], cfg, 1).startswith("warning: no learning signal in the first 1 step: ")


def test_the_speedruns_no_signal_warning_names_its_preset_keys():
    """The README's tiny speedrun ends its RL stage with this warning, which told its user to change
    --samples-per-prompt and --temperature, flags the speedrun does not take: it names the preset's keys, as the
    speedrun's other lines do (speedrun_flags), and the start it lays out."""
    cfg = from_dict(RLConfig, {"samples_per_prompt": 2, "temperature": 1.0, "max_operand": 99})
    option = speedrun_flags("tiny", "rl").option
    failed = {"reward_mean": 0.0, "pass_at_1": 0.0, "zero_advantage_frac": 1.0}
    assert no_signal_warning([failed], cfg, 1, option) == (
        "warning: no learning signal in the first 1 step: all 2 samples of every prompt failed (mean reward 0), "
        "so every advantage and the policy gradient were 0; try a stronger start than the SFT checkpoint (a "
        "checkpoint that solves some rl.task calculator prompts), more rl.samples_per_prompt (now 2) or a "
        "higher rl.temperature (now 1)"
    )
    solved = {"reward_mean": 1.0, "pass_at_1": 1.0, "zero_advantage_frac": 1.0}
    assert no_signal_warning([solved], cfg, 1, option) == (
        "warning: no learning signal in the first 1 step: all 2 samples of every prompt were solved (mean reward "
        "1), so every advantage and the policy gradient were 0: rl.task calculator is too easy for this policy; "
        "give it harder prompts (a larger rl.max_operand (now 99) or another rl.task) or stop here. A stronger "
        "start than the SFT checkpoint cannot help, and more rl.samples_per_prompt (now 2) or a higher "
        "rl.temperature (now 1) only finds a rare failure to learn from"
    )
    one_step = from_dict(
        RLConfig, {"samples_per_prompt": 2, "temperature": 1.0, "steps": 1}
    )  # the tiny preset's
    watch = NoSignalWatch(one_step, option)  # RLRun's, made with the speedrun's flags
    assert watch.add(1, failed) == no_signal_warning([failed], cfg, 1, option)


def test_a_run_that_solves_every_sample_is_told_its_task_is_too_easy():
    """Every sample of every prompt solved (reward 1) leaves no signal either, and was told the same as all
    failed: a stronger --init-from, more samples, a higher temperature. It says the task is too easy and what
    gives a signal: harder prompts (calculator: --max-operand) or another task."""
    cfg = from_dict(RLConfig, {"samples_per_prompt": 4, "temperature": 0.7, "max_operand": 99})
    solved = {"reward_mean": 1.0, "pass_at_1": 1.0, "zero_advantage_frac": 1.0}
    assert no_signal_warning([solved] * NO_SIGNAL_STEPS, cfg, 50) == (
        "warning: no learning signal in the first 5 steps: all 4 samples of every prompt were solved (mean "
        "reward 1), so every advantage and the policy gradient were 0: --task calculator is too easy for this "
        "policy; give it harder prompts (a larger --max-operand (now 99) or another --task) or stop here. A "
        "stronger --init-from cannot help, and more --samples-per-prompt (now 4) or a higher --temperature "
        "(now 0.7) only finds a rare failure to learn from"
    )
    gsm8k = from_dict(RLConfig, {"task": "gsm8k", "samples_per_prompt": 4})
    assert (
        "--task gsm8k is too easy for this policy; give it harder prompts (another --task) or stop here"
        in (no_signal_warning([solved] * NO_SIGNAL_STEPS, gsm8k, 50))
    )
    # some prompts all failed, the others all solved: only varied samples within a prompt give a signal
    half = {"reward_mean": 0.5, "pass_at_1": 0.5, "zero_advantage_frac": 1.0}
    failed = {"reward_mean": 0.0, "pass_at_1": 0.0, "zero_advantage_frac": 1.0}
    assert no_signal_warning([failed, solved, half, failed, failed], cfg, 50) == (
        "warning: no learning signal in the first 5 steps: the 4 samples of each prompt got the same reward "
        "(mean reward 0.3: some prompts all failed, the others all solved), so every advantage and the policy "
        "gradient were 0; try more --samples-per-prompt (now 4) or a higher --temperature (now 0.7), so that "
        "a prompt's samples differ"
    )


def test_the_no_signal_warning_is_printed_once_a_run():
    """RLRun's loop started a new list of first steps each time it ran: after an actor group restart (resuming
    from the checkpoint of step 2) the redone steps printed the warning again, and a run resumed by another
    invocation printed it over its own first steps. NoSignalWatch (kept by RLRun across restarts) warns over the
    run's steps 1..NO_SIGNAL_STEPS, once."""
    cfg = from_dict(RLConfig, {"steps": 50, "samples_per_prompt": 4})
    silent = {"reward_mean": 0.0, "pass_at_1": 0.0, "zero_advantage_frac": 1.0}
    watch = NoSignalWatch(cfg)
    printed = [watch.add(step, silent) for step in range(1, NO_SIGNAL_STEPS + 1)]
    assert printed[:-1] == [None] * (NO_SIGNAL_STEPS - 1)
    assert printed[-1].startswith("warning: no learning signal in the first 5 steps: all 4 samples")
    # an actor group restart resumes from checkpoint 2 and redoes steps 3..10
    assert [watch.add(step, silent) for step in range(3, 11)] == [None] * 8
    # another invocation resuming from checkpoint 2 never saw steps 1 and 2
    resumed = NoSignalWatch(cfg)
    assert [resumed.add(step, silent) for step in range(3, 11)] == [None] * 8
    # a restart whose redone step 3 has a signal: the first steps were silent only before it, no warning
    watch = NoSignalWatch(cfg)
    assert [watch.add(step, silent) for step in (1, 2, 3, 4)] == [None] * 4
    signal = {"reward_mean": 0.25, "pass_at_1": 0.25, "zero_advantage_frac": 0.5}
    assert [watch.add(step, r) for step, r in ((3, signal), (4, silent), (5, silent))] == [None] * 3
    # a run shorter than NO_SIGNAL_STEPS: warned after its last step
    short = NoSignalWatch(from_dict(RLConfig, {"steps": 2, "samples_per_prompt": 4}))
    assert short.add(1, silent) is None and short.add(2, silent).startswith(
        "warning: no learning signal in the first 2 steps"
    )
