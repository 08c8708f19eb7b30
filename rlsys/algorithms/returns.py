"""Discounted returns over the turns of one trajectory: a multi-turn episode's reward, which the rollout worker
computes, and GiGPO's per-step returns. Plain Python, so the rollout workers import no torch for it."""


def discounted_turn_returns(turn_rewards: list[float], gamma: float) -> list[float]:
    """G_k = r_k + gamma * G_{k+1} over the turns of one trajectory, G after the last turn = 0."""
    returns, running = [0.0] * len(turn_rewards), 0.0
    for k in reversed(range(len(turn_rewards))):
        running = turn_rewards[k] + gamma * running
        returns[k] = running
    return returns
