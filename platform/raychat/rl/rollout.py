"""Rollout actor: a ModelRunner over the current policy; samples G completions per prompt with tool use, scores
them with `Task.reward`, and tags every sample with the policy version that produced it.

Sample (a dict, what the learner consumes):
    prompt_index: int      the prompt's index in the task (train or test split)
    sample_index: int      j of the prompt's G samples
    tokens, mask: list[int]  prompt + completion, mask 1 = sampled, 0 = prompt / forced tool output (engine)
    reward: float          Task.reward(conversation, completion text); 0 when it raised (the result counts it)
    version: int           policy version of the weights that generated it (0 = the checkpoint's weights,
                           which a restarted actor holds until it is synced)
    worker: int            rollout actor index
    completion_tokens: int tokens after the prompt (sampled + forced); sampled_tokens: mask-1 tokens
    finish_reason: str     "stop" | "length"
    behavior_logprobs: list[float] | None   log pi_behavior of tokens[1:] at the rollout temperature
                            (asynchronous mode only; one value per label; the loss uses those of the
                            sampled tokens only: objective.per_token_loss)
"""

from __future__ import annotations

import math
import os
import pickle
import time
import traceback

import ray
import torch

from raychat.chat_template import render_for_completion
from raychat.checkpoint import load_model
from raychat.engine import KVCache, ModelRunner
from raychat.gc_heap import freeze_gc_heap
from raychat.rl.objective import collate, token_logprobs
from raychat.rl.weights import collective_broadcast, leave_collective_group, load_published, weights_hash


class RolloutWorker:
    """Holds one ModelRunner. Usable in-process (tests) or as a Ray actor (`RolloutActor`).

    Args:
        checkpoint: chat checkpoint directory (weights are replaced by set_weights before use in a run).
        tasks: {"train": Task, "test": Task} -- split name -> task giving conversations and rewards.
        worker_index: this actor's index (tagged on samples).
        device: "cpu" or "cuda".
        num_threads: torch intra-op threads (None = leave torch's default).
        max_slots: KV-cache rows decoded at once (--max-slots, >= every call's num_samples; None = no bound): a
            rollout or evaluation of more prompts x samples is generated in batches of whole prompts
            (ModelRunner.generate_batch's max_rows), and the engine's kv_budget_bytes is serving's slot budget,
            max_slots x the model's max_seq_len x KVCache.bytes_per_token (a batch beyond it: KVBudgetError).
    """

    def __init__(
        self,
        checkpoint: str,
        tasks: dict,
        worker_index: int = 0,
        device: str = "cpu",
        num_threads=None,
        max_slots: int | None = None,
    ):
        if num_threads:
            torch.set_num_threads(int(num_threads))
        model, tokenizer, _ = load_model(checkpoint, device=device)
        self.model, self.tokenizer, self.tasks = model.eval(), tokenizer, tasks
        # the learner's dtype ("model"), never cast: on-policy samples come from the weights it trains
        self.engine = ModelRunner(model, tokenizer, dtype="model")
        self.max_slots = max_slots
        if max_slots is not None:
            per_row = model.config.max_seq_len * KVCache.bytes_per_token(model.config, self.engine.kv_dtype)
            self.engine.kv_budget_bytes = max_slots * per_row
        self.worker_index, self.version = worker_index, 0
        self.hash = weights_hash(model.state_dict())
        freeze_gc_heap()  # the actor's model and imports: never scanned by the cyclic GC again

    # ---- weights -------------------------------------------------------------------------------------
    def set_weights(self, refs: list, version: int) -> dict:
        """Load the published state dict (refs = [ObjectRef], fetched here) as policy `version`.

        Returns {"version", "hash", "apply_s" (fetch + load seconds), "worker"}.
        """
        self.hash, apply_s = load_published(self.model, refs)
        self.engine.refresh_weights()
        self.version = int(version)
        return {"version": self.version, "hash": self.hash, "apply_s": apply_s, "worker": self.worker_index}

    def receive_broadcast(self, group_name: str, version: int) -> dict:
        """Collective path: receive every tensor from rank 0 (the learner) in place; same ack as set_weights."""
        apply_s = collective_broadcast(self.model, group_name)
        self.engine.refresh_weights()  # the collective writes the tensors' memory directly
        self.hash, self.version = weights_hash(self.model.state_dict()), int(version)
        return {"version": self.version, "hash": self.hash, "apply_s": apply_s, "worker": self.worker_index}

    def leave_collective(self, group_name: str) -> None:
        """Leave the broadcast group (raychat.rl.weights.leave_collective_group), so it can be rebuilt."""
        leave_collective_group(group_name)

    def info(self) -> dict:
        return {"version": self.version, "hash": self.hash, "pid": os.getpid(), "worker": self.worker_index}

    # ---- generation ----------------------------------------------------------------------------------
    def _prompts(self, split: str, indices: list[int]) -> tuple[list[dict], list[list[int]]]:
        if split not in self.tasks:
            raise ValueError(f"split must be one of {sorted(self.tasks)}, got {split!r}")
        conversations = [self.tasks[split][i] for i in indices]
        return conversations, [
            render_for_completion(self.tokenizer, c["messages"][:-1]) for c in conversations
        ]

    def rollout(
        self,
        indices: list[int],
        num_samples: int,
        max_tokens: int,
        temperature: float,
        seed: int | None = None,
        split: str = "train",
        behavior_logprobs: bool = False,
        min_version: int = 0,
    ) -> dict:
        """Generate num_samples completions for each prompt index; score them.

        min_version: the oldest policy version this rollout may use. An actor holding older weights (a
        restarted one holds the checkpoint's, version 0) generates nothing: it returns no samples and its
        version, and the dispatcher re-syncs it and issues the prompts again.

        Returns {"samples": list[Sample dict] (prompt-major), "seconds": generation wall time, "wall_s": the
        call's wall time (generation, scoring, behavior log-probs; seconds), "completion_tokens": int, "worker":
        int, "version": int} and ScoreErrors.result()'s keys (the samples whose Task.reward raised: scored 0).
        """
        if self.version < min_version:
            return {"samples": [], "seconds": 0.0, "wall_s": 0.0, "completion_tokens": 0,
                    "worker": self.worker_index, "version": self.version}  # fmt: skip
        began = time.perf_counter()
        conversations, prompts = self._prompts(split, indices)
        t0 = time.perf_counter()
        results = self._generate(prompts, num_samples, max_tokens, temperature, seed)
        seconds = time.perf_counter() - t0
        task = self.tasks[split]
        samples, errors = [], ScoreErrors()
        for r in results:
            conv = conversations[r.prompt_index]
            samples.append(
                {
                    "prompt_index": int(indices[r.prompt_index]),
                    "sample_index": r.sample_index,
                    "tokens": r.tokens,
                    "mask": r.mask,
                    "reward": errors.score(task.reward, conv, r.text, indices[r.prompt_index]),
                    "version": self.version,
                    "worker": self.worker_index,
                    "completion_tokens": len(r.completion_tokens),
                    "sampled_tokens": sum(r.completion_mask),
                    "finish_reason": r.finish_reason,
                    "text": r.text,
                }
            )
        if behavior_logprobs:
            for s, lp in zip(samples, self.logprobs(samples, temperature)):
                s["behavior_logprobs"] = lp
        return {
            "samples": samples,
            "seconds": seconds,
            "wall_s": time.perf_counter() - began,
            "completion_tokens": sum(s["completion_tokens"] for s in samples),
            "worker": self.worker_index,
            "version": self.version,
            **errors.result(),
        }

    def _generate(
        self,
        prompts,
        num_samples: int,
        max_tokens: int,
        temperature: float,
        seed: int | None,
        seed_offset: int = 0,
    ):
        """The engine's generate_batch of `prompts`, at most --max-slots KV-cache rows decoding at once."""
        return self.engine.generate_batch(
            prompts, num_samples=num_samples, max_tokens=max_tokens, temperature=temperature, seed=seed,
            max_rows=self.max_slots, seed_offset=seed_offset,
        )  # fmt: skip

    @torch.inference_mode()
    def logprobs(self, samples: list[dict], temperature: float, chunk: int = 16) -> list[list[float]]:
        """log softmax(logits / temperature)[label] of tokens[1:] for every sample (one forward per chunk)."""
        out = []
        for c in range(0, len(samples), chunk):
            part = [{**s, "advantage": 0.0, "behavior_logprobs": None} for s in samples[c : c + chunk]]
            batch = collate(part)
            logits = self.model(batch["input_ids"].to(self.engine.device))
            lp = token_logprobs(logits, batch["labels"].to(logits.device), temperature).cpu()
            out += [lp[i, : len(s["tokens"]) - 1].tolist() for i, s in enumerate(part)]
        return out

    def evaluate(
        self,
        indices: list[int],
        num_samples: int,
        max_tokens: int,
        temperature: float,
        seed: int | None = None,
        min_version: int = 0,
        seed_offset: int = 0,
    ) -> dict:
        """Correct completions (Task.evaluate) per held-out prompt, out of num_samples each.

        min_version: as in rollout(): an actor holding older weights (restarted) evaluates nothing.
        seed_offset: prompt i is sampled as prompt seed_offset + i of a call seeded `seed` (the engine's
        generate_batch): a part of the held-out prompts evaluated in chunks samples what it samples in one call.
        Returns {"correct": list[int] (one count per index; [] when refused), "version": int, "worker": int,
        "wall_s": the call's wall time (seconds)} and ScoreErrors.result()'s keys (the samples whose
        Task.is_correct raised: counted incorrect).
        """
        if self.version < min_version:
            return {"correct": [], "version": self.version, "worker": self.worker_index, "wall_s": 0.0}
        began = time.perf_counter()
        conversations, prompts = self._prompts("test", indices)
        results = self._generate(prompts, num_samples, max_tokens, temperature, seed, seed_offset)
        correct, errors = [0] * len(indices), ScoreErrors()
        for r in results:
            conv = conversations[r.prompt_index]
            correct[r.prompt_index] += int(
                errors.score(self.tasks["test"].is_correct, conv, r.text, indices[r.prompt_index])
            )
        return {"correct": correct, "version": self.version, "worker": self.worker_index,
                "wall_s": time.perf_counter() - began, **errors.result()}  # fmt: skip


class ScoreErrors:
    """Scores completions with a task's reward or checker, a call that raises scoring 0 (one bad sample does not
    end the run); counts them and keeps the first error."""

    def __init__(self):
        self.scored = self.raised = 0
        self.first: BaseException | None = None
        self.first_traceback = ""
        self.first_prompt: int | None = None

    def score(self, fn, conversation: dict, completion: str, prompt_index: int) -> float:
        """float(fn(conversation, completion)); 0.0 when it raises an Exception or returns NaN or +-inf (a
        ValueError naming the value, which would make its group's advantages NaN): counted, the first kept."""
        self.scored += 1
        try:
            value = float(fn(conversation, completion))
            if not math.isfinite(value):
                raise ValueError(f"returned {value}, not a finite number")
            return value
        except Exception as e:
            self.raised += 1
            if self.first is None:
                self.first, self.first_prompt = e, int(prompt_index)
                self.first_traceback = traceback.format_exc()
            return 0.0

    def result(self) -> dict:
        """{"scored": completions scored, "reward_errors": how many raised, "reward_error": the first error
        (None if none; a RuntimeError with its type and message when it does not pickle), "reward_traceback": its
        traceback (text), "reward_error_prompt": its prompt's index}."""
        error = self.first
        if error is not None:
            try:
                pickle.dumps(error)
            except Exception:
                error = RuntimeError(f"{type(error).__name__}: {error}")
        return {"scored": self.scored, "reward_errors": self.raised, "reward_error": error,
                "reward_traceback": self.first_traceback, "reward_error_prompt": self.first_prompt}  # fmt: skip


RolloutActor = ray.remote(RolloutWorker)
