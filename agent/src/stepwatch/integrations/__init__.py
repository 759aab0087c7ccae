"""One line in the trainers people use (README "In a trainer"): each module imports its framework when it is
imported itself, never when `stepwatch` is, and says which versions it needs when that import fails."""
