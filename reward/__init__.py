"""The language-compliance reward: the scorer and its registry of terms, the labels it judges
against, degeneracy measures, and adapters to the RL engines' call conventions."""
