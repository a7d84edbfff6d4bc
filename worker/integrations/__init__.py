"""Drop-in reward functions for the trainers people run (docs/integrations.md): ``trl``
(``reward_function`` for ``GRPOTrainer(reward_funcs=[...])``), ``verl`` (``compute_score`` for
``reward.custom_reward_function``) and ``verl_manager`` (the token-exact
``ScoringRewardManager`` for ``reward.reward_manager.source=importlib``), over ``shared`` (one
asyncio client and coalescer per process, event loop and queue).

Producers: they import the client side only, never torch; the verl manager imports verl's base
class when verl is installed (and stands alone otherwise).
"""
