"""pydblp: loss-tolerant gradient transport."""
__version__ = "0.1.0"
