"""Loaders of real dataset formats, each yielding `vitscope.data.base.Sample`s and model-ready batches."""

from vitscope.data.formats.cifar import Cifar
from vitscope.data.formats.coco import CocoInstances, PartImageNet
from vitscope.data.formats.common import IMAGE_EXTENSIONS, FileDataset, SkippedImagesWarning, Unreadable
from vitscope.data.formats.davis import Davis
from vitscope.data.formats.imagefolder import ImageFolder, read_class_list
from vitscope.data.formats.revisited import RevisitedRetrieval
from vitscope.data.formats.robustness import CorruptedFolder, CueConflictFolder
from vitscope.data.formats.spair import SPair71k

__all__ = ["IMAGE_EXTENSIONS", "Cifar", "CocoInstances", "CorruptedFolder", "CueConflictFolder", "Davis", "FileDataset",
           "ImageFolder", "PartImageNet",
           "RevisitedRetrieval", "SPair71k", "SkippedImagesWarning", "Unreadable", "read_class_list"]
