"""Local .txt/.jsonl(.xz|.gz) files as a TFDS dataset in ArrayRecord format, without TensorFlow.

  from focaljax.data import tfds_text
  tfds_text.build("/data/books/*.jsonl.xz", "/data/tfds", name="books")
  # then train with --config.data.source=tfds:books --config.data.tfds_data_dir=/data/tfds

The dataset has one feature, `text` (a string), and two splits, `train` and `validation`.
Reading goes through `tfds.data_source(name, split, data_dir)` (focaljax.data.sources):
ArrayRecord random access that Grain can shuffle and shard by index.

The TF-free path: `file_format=array_record` (TFRecord writing/reading would import TF);
`tfds.features.Text` encodes with plain Python and `data_source` decodes with numpy; readers pass
`download=False`, so TFDS never tries to prepare (our builder needs its documents, which only
`build` has). A dataset built under any name is read back from its files alone (TFDS's read-only
builder), so readers need neither this module's classes nor the original text files.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
import functools

import tensorflow_datasets as tfds

from focaljax.data import sources

_VERSION = "1.0.0"


class LocalText(tfds.core.GeneratorBasedBuilder):
  """Documents of local text files; `build` makes a copy of this class under a chosen name."""

  VERSION = tfds.core.Version(_VERSION)
  RELEASE_NOTES = {_VERSION: "Documents of local .txt/.jsonl(.xz|.gz) files."}
  # TFDS locates a builder's source file only to find download checksums, which we don't have;
  # its lookup needs the `importlib_resources` backport, so skip it.
  code_path = None

  def __init__(self, *, train_docs: Sequence[str] = (), valid_docs: Sequence[str] = (), **kwargs):
    # Documents come in memory rather than as paths so that the split rule lives in one place
    # (focaljax.data.sources) and TFDS's download manager is never involved.
    self._split_docs = {"train": train_docs, "validation": valid_docs}
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
        features=tfds.features.FeaturesDict({"text": tfds.features.Text()}),
        description="Documents of local text files (focaljax.data.tfds_text).",
        # Keep the files' document order (TFDS would otherwise order by key hash); Grain
        # shuffles at read time.
        disable_shuffling=True,
    )

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    del dl_manager  # Nothing to download.
    return {split: self._generate_examples(split) for split in self._split_docs}

  def _generate_examples(self, split: str) -> Iterator[tuple[str, dict[str, str]]]:
    for i, text in enumerate(self._split_docs[split]):
      yield f"{split}-{i}", {"text": text}


@functools.cache
def _builder_class(name: str) -> type[LocalText]:
  if name == LocalText.name:
    return LocalText
  # skip_registration: a built dataset is found through its files, so a second process (or a
  # second build in this one) never depends on, or collides with, a registered class.
  return type(f"LocalText_{name}", (LocalText,), {"name": name, "__module__": __name__},
              skip_registration=True)


def build(files: str | Sequence[str], data_dir: str, *, name: str = "local_text",
          valid_files: str | Sequence[str] | None = None, valid_fraction: float = 0.05,
          jsonl_field: str = "text") -> str:
  """Prepares TFDS dataset `name` (splits train/validation) under `data_dir`; returns its dir.

  `files` / `valid_files` are paths or comma-separated globs. Without `valid_files`, validation
  holds out `valid_fraction` of the documents by the evenly spaced rule of sources.documents.
  Document order follows the (sorted) files; TFDS keeps it (no shuffling at write time).
  An already prepared dataset of this name and version is kept as is: delete its dir to rebuild.
  """
  join = lambda f: f if isinstance(f, str) else ",".join(f)
  valid_source = None if valid_files is None else f"text:{join(valid_files)}"
  split_docs = [sources.documents(s, f"text:{join(files)}", valid_source=valid_source,
                                  valid_fraction=valid_fraction, jsonl_field=jsonl_field)
                for s in sources.SPLITS]
  builder = _builder_class(name)(
      train_docs=[split_docs[0][i] for i in range(len(split_docs[0]))],
      valid_docs=[split_docs[1][i] for i in range(len(split_docs[1]))],
      data_dir=data_dir,
      file_format="array_record",
  )
  builder.download_and_prepare(
      download_config=tfds.download.DownloadConfig(
          compute_stats=tfds.download.ComputeStatsMode.SKIP))
  return str(builder.data_dir)
