"""`sits keys`: make and rotate the keys that sign healing commands.

A key file holds one key per line, `<key id> <base64 secret>`; the decision and
the validator sign with its first key, the executor accepts every key in its
own file. Rotation with no downtime (each step is picked up within a second,
no restart):

    sits keys add executor-keys --id 2027-01        # 1. executors accept the new key too
    sits keys add signing-key --id 2027-01 --first  # 2. signers use it (same secret: copy the line)
    sits keys remove executor-keys 2026-12          # 3. once no command signed with the old one can be in flight

`add --from FILE` copies a key (id and secret) from another file instead of making one.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from sits.runtime.signing import KeyFileError, SigningKey, new_key, read_keys, write_key_file


def configure_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    new = sub.add_parser("new", help="write a key file holding one new key")
    new.add_argument("file", type=Path)
    new.add_argument("--id", default=None, help="key id (default: the current year and month)")
    new.add_argument("--force", action="store_true", help="replace an existing file")
    add = sub.add_parser("add", help="add a key to a key file (a new one, or one copied --from another file)")
    add.add_argument("file", type=Path)
    add.add_argument("--id", default=None, help="key id of the new key, or of the key to copy")
    add.add_argument("--from", dest="source", type=Path, default=None, help="copy the key from this file")
    add.add_argument("--first", action="store_true", help="make it the first key (the one signers use)")
    remove = sub.add_parser("remove", help="remove a key from a key file")
    remove.add_argument("file", type=Path)
    remove.add_argument("id")
    show = sub.add_parser("list", help="the key ids of a key file, signing one first (never the secrets)")
    show.add_argument("file", type=Path)


def _default_id() -> str:
    return time.strftime("%Y-%m-%d-%H%M%S", time.gmtime())


def _key_to_add(args: argparse.Namespace) -> SigningKey:
    if args.source is None:
        return new_key(args.id or _default_id())
    keys = read_keys(args.source)
    if args.id is None:
        return keys[0]
    for key in keys:
        if key.key_id == args.id:
            return key
    raise KeyFileError(f"{args.source} holds no key {args.id!r}")


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "new":
            if args.file.exists() and not args.force:
                raise KeyFileError(f"{args.file} exists (--force replaces it)")
            key = new_key(args.id or _default_id())
            write_key_file(args.file, [key])
            print(f"{args.file}: key {key.key_id}")
        elif args.action == "add":
            keys = list(read_keys(args.file))
            key = _key_to_add(args)
            if any(k.key_id == key.key_id for k in keys):
                raise KeyFileError(f"{args.file} already holds key id {key.key_id!r}")
            keys = [key, *keys] if args.first else [*keys, key]
            write_key_file(args.file, keys)
            print(f"{args.file}: keys {', '.join(k.key_id for k in keys)}")
        elif args.action == "remove":
            keys = [k for k in read_keys(args.file) if k.key_id != args.id]
            if len(keys) == len(read_keys(args.file)):
                raise KeyFileError(f"{args.file} holds no key {args.id!r}")
            if not keys:
                raise KeyFileError(f"{args.id!r} is the last key of {args.file}; a key file needs one")
            write_key_file(args.file, keys)
            print(f"{args.file}: keys {', '.join(k.key_id for k in keys)}")
        else:
            print("\n".join(k.key_id for k in read_keys(args.file)))
    except KeyFileError as err:
        print(f"sits keys: {err}", file=sys.stderr)
        return 2
    return 0
