"""End-to-end HSTU models: next-item retrieval and multi-task ranking."""

from tzrec_gr.models.config import MODEL_CLASSES, build_from_config
from tzrec_gr.models.ranking import HSTURanking
from tzrec_gr.models.retrieval import HSTURetrieval

__all__ = ["MODEL_CLASSES", "HSTURanking", "HSTURetrieval", "build_from_config"]
