"""``python -m services.deploy.etcd_auth --endpoint HOST:PORT``: turn on etcd's authentication for Poise.

The one-shot ``etcd-auth`` container of docker-compose and ``make deploy`` runs it once etcd is healthy: it
creates ``root`` and the ``poise`` user (read-write on ``/poise/`` only) with the passwords in
``POISE_ETCD_ROOT_PASSWORD`` and ``POISE_ETCD_PASSWORD``, and per ``--worker ID`` the sidecar's own user
(``POISE_ETCD_PASSWORD_WORKER_<ID>``: reads ``/poise/``, writes its instance key only), then enables auth (:func:`shared.security.enable_etcd_auth`,
the same call ``poise up`` makes). Exits 0 when auth is on, also when it already was (a restart).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from services.deploy.secrets import etcd_password_var
from shared.protocol import Keys
from shared.protocol.permissions import worker_user
from shared.security import ETCD_USER, enable_etcd_auth


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.deploy.etcd_auth", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--endpoint", required=True, help="etcd client endpoint, host:port")
    parser.add_argument("--wait-s", type=float, default=60.0, help="how long to wait for etcd to answer")
    parser.add_argument("--namespace", default="default", help="Poise namespace (the workers' instance keys)")
    parser.add_argument("--worker", action="append", default=[], metavar="ID",
                        help="a sidecar's instance id: its own etcd user, writing its instance key only (repeat)")
    args = parser.parse_args(argv)
    root, password = os.environ.get("POISE_ETCD_ROOT_PASSWORD"), os.environ.get("POISE_ETCD_PASSWORD")
    if not root or not password:
        print("error: set POISE_ETCD_ROOT_PASSWORD and POISE_ETCD_PASSWORD", file=sys.stderr)
        return 2
    keys = Keys(args.namespace)
    workers = {}
    for instance_id in args.worker:
        secret = os.environ.get(etcd_password_var(instance_id))
        if not secret:
            print(f"error: set {etcd_password_var(instance_id)} (worker {instance_id})", file=sys.stderr)
            return 2
        workers[worker_user(instance_id)] = (secret, keys.instance(instance_id))
    import grpc

    deadline = time.monotonic() + args.wait_s
    while True:
        try:
            changed = enable_etcd_auth(args.endpoint, root_password=root, user=ETCD_USER, password=password,
                                       workers=workers)
            break
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:  # type: ignore[attr-defined]
                print(f"error: could not turn on etcd's authentication at {args.endpoint}: {exc}", file=sys.stderr)
                return 1
            time.sleep(1.0)
    users = ", ".join(["root", ETCD_USER, *workers])
    print(f"etcd at {args.endpoint}: " + (f"authentication turned on (users {users})" if changed
                                          else "authentication was already on; nothing changed"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
