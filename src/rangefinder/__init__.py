"""rangefinder's pipeline steps and the engine they share."""

import logging
import re

__version__ = "0.1.0"


class _TorchvisionFallbackFilter(logging.Filter):
    """Drops transformers' one line that an image processor falls back to its PIL backend without torchvision, which
    rangefinder never installs (pyproject.toml) and needs no image processor from. diffusers' Stable Diffusion
    pipeline and IP-Adapter modules import CLIPImageProcessor and SiglipImageProcessor, so every `train`, sample and
    step printed it (transformers 5: `<Name>ImageProcessor` now means the torchvision backend). Every other record of
    that logger passes."""

    FALLBACK = re.compile(r"`\w+ImageProcessor` requires torchvision \(not installed\); falling back to "
                          r"`\w+ImageProcessorPil`")

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.FALLBACK.match(record.getMessage())


# On the logger by its name, which transformers' logging.get_logger returns once it is imported: nothing is imported
# here, and the filter is in place before any import of diffusers' pipelines, in every process that imports rangefinder.
logging.getLogger("transformers.utils.import_utils").addFilter(_TorchvisionFallbackFilter())


class _SqlStoreErrorFilter(logging.Filter):
    """Drops the traceback MLflow's SQL store logs (`logger.exception`) for a query the database did not run, before
    it raises the same error as an MlflowException: a SQLite database another program holds ("database is locked")
    printed SQLAlchemy's traceback into a step's log, which goes on with its records in the spool
    (tracking/outbox.py) and says it in one line; where the error ends a command, its line names it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("SQLAlchemy database error")


logging.getLogger("mlflow.store.db.utils").addFilter(_SqlStoreErrorFilter())
