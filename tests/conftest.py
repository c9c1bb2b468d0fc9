import os
import sys

# Let test modules import shared helpers from each other (e.g. the hand-written plans).
sys.path.insert(0, os.path.dirname(__file__))
