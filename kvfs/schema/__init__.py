"""The kvfs on-disk format, defined in code; docs/format.md explains it (a test keeps them in step).

``layout``  the device layout: superblock, checkpoint header, journal frame header, MMP record
            (``struct`` layouts with size asserts and a comment on every field)
``records`` the journal records and the checkpoint state as named types, with
            their msgpack encoding; nothing else knows a field's position
``writer``  a checkpoint payload encoded row by row as each layer makes its rows
``stream``  a checkpoint payload decoded row by row as mount consumes them

``FORMAT_VERSION`` is in the superblock; a reader refuses versions it does not
list in ``READABLE_VERSIONS``, so a
format change is a deliberate, versioned step (tests/images holds a store of
today's format that every version must keep reading).
"""
from .layout import (CHECKPOINT_HEADER, CHECKPOINT_HEADER_FIELDS, JOURNAL_FRAME_FIELDS, field_layout, DEFAULT_BLOCK_SIZE, FOREIGN_SIGNATURES, FORMAT_VERSION,
                     JOURNAL_FRAME, MAGIC_CHECKPOINT, MAGIC_JOURNAL, MAGIC_SUPERBLOCK, MAX_BLOCK_SIZE,
                     MIN_BLOCK_SIZE, MIN_DEVICE_SIZE, SUPERBLOCK, SUPERBLOCK_CHECKED, SUPERBLOCK_V1,
                     SUPERBLOCK_V1_CHECKED, KEY_SECRET_LEN, READABLE_VERSIONS, Superblock,
                     check_block_size, check_device_size, decode_checkpoint_header, decode_journal_header,
                     encode_checkpoint_header, encode_journal_frame, frame_size, identify_existing_data,
                     MAGIC_MMP, MMP_CLEAN, MMP_IN_USE, MMP_MAX_INTERVAL_MS, MMP_RECORD, MMP_RECORD_CHECKED,
                     MMP_RECORD_FIELDS, MMP_STATES, MmpRecord)
from .records import (RECORD_TYPES, Attrs, BlockRef, BlockRow, CheckpointState, Content,
                      InodeRow, Link, Make, Move, Remove, decode_record)
from ..base.aligned import SECTOR, align_down, align_up
from .writer import CheckpointWriter, write_state

__all__ = [
    "CHECKPOINT_HEADER_FIELDS",
    "JOURNAL_FRAME_FIELDS",
    "field_layout",
    "CHECKPOINT_HEADER",
    "DEFAULT_BLOCK_SIZE",
    "FOREIGN_SIGNATURES",
    "FORMAT_VERSION",
    "JOURNAL_FRAME",
    "MAGIC_CHECKPOINT",
    "MAGIC_JOURNAL",
    "MAGIC_SUPERBLOCK",
    "MAX_BLOCK_SIZE",
    "MIN_BLOCK_SIZE",
    "MIN_DEVICE_SIZE",
    "SUPERBLOCK",
    "SUPERBLOCK_CHECKED",
    "SUPERBLOCK_V1",
    "SUPERBLOCK_V1_CHECKED",
    "KEY_SECRET_LEN",
    "READABLE_VERSIONS",
    "Superblock",
    "check_block_size",
    "check_device_size",
    "decode_checkpoint_header",
    "decode_journal_header",
    "encode_checkpoint_header",
    "encode_journal_frame",
    "frame_size",
    "identify_existing_data",
    "MAGIC_MMP",
    "MMP_CLEAN",
    "MMP_IN_USE",
    "MMP_MAX_INTERVAL_MS",
    "MMP_RECORD",
    "MMP_RECORD_CHECKED",
    "MMP_RECORD_FIELDS",
    "MMP_STATES",
    "MmpRecord",
    "RECORD_TYPES",
    "Attrs",
    "BlockRef",
    "BlockRow",
    "CheckpointState",
    "CheckpointWriter",
    "write_state",
    "Content",
    "InodeRow",
    "Link",
    "Make",
    "Move",
    "Remove",
    "decode_record",
    "SECTOR",
    "align_down",
    "align_up",
]
