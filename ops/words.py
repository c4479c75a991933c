"""Words the ops scripts build prompts from (each takes the first N it needs)."""

WORDS = [
    "river",
    "stone",
    "lamp",
    "harbor",
    "winter",
    "copper",
    "garden",
    "signal",
    "orchard",
    "violet",
    "thunder",
    "ladder",
    "meadow",
    "candle",
    "engine",
    "quiet",
    "falcon",
]
