"""The producer side of quantization: ``ascent quantize`` writes ModelSlim or compressed-tensors checkpoints.

``rtn`` (round-to-nearest math and integer packings), ``calibrate`` (activation statistics on the local corpus),
``smoothquant`` (exact smoothing folds), ``schemes`` (the ``--scheme`` table), ``modelslim_writer`` / ``ct_writer``
(the two layouts), ``quantize`` (the pipeline), ``cli`` (the sub-command). Nothing here imports the loading side.
"""

from ascent.quantization.export.quantize import ExportResult, export_float_model, quantize_model

__all__ = ["ExportResult", "export_float_model", "quantize_model"]
