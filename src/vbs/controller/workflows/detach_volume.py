"""The detach-volume workflow (rolls forward): unplug from the VM and wait for the guest to let go, then
remove the export, then mark it detached; a guest that holds the disk leaves the attachment ``busy``.
"""

from __future__ import annotations

from collections.abc import Callable

from vbs.controller.db.states import AttachmentState
from vbs.controller.workflows.attach_volume import settle, unexport_volume
from vbs.controller.workflows.definition import Params, Step, StepContext, Workflow
from vbs.errors import DeviceBusy


class DetachParams(Params):
    attachment_id: str
    node: str
    pool: str = ""  # older controllers did not record it: read from the volume then
    host: str
    vm_id: str
    serial: str
    force: bool = False
    timeout: float = 10.0
    # A local volume (semi-shared storage) that outlives its detach; a non-persistent one is removed.
    persistent: bool = False


def unplug_from_vm(ctx: StepContext[DetachParams]) -> None:
    p = ctx.params
    ctx.services.agents.host(p.host).detach(p.vm_id, p.serial, force=p.force, timeout=p.timeout)


def mark_detached(ctx: StepContext[DetachParams]) -> None:
    settle(ctx, AttachmentState.DETACHED)


def detach_ends_busy(ctx: StepContext[DetachParams], reason: str) -> None:
    """The detach could not finish: the attachment is ``busy``; detach again, or with force."""
    settle(ctx, AttachmentState.BUSY, reason)


def guest_holds_disk(ctx: StepContext[DetachParams], exc: Exception) -> bool:
    if not isinstance(exc, DeviceBusy):
        return False
    detach_ends_busy(ctx, exc.message)
    return True


def detaching(kind: str, release: Step[DetachParams], mark: Callable[[StepContext[DetachParams]], None], *,
              exclusive: bool) -> Workflow[DetachParams]:
    """A detach (rolls forward): unplug the disk from the VM, ``release`` what served it, then ``mark`` it
    detached (in the transaction that ends the operation); a guest that holds the disk leaves the
    attachment ``busy``."""
    return Workflow(
        kind=kind,
        exclusive=exclusive,
        params=DetachParams,
        resume="forward",
        # A forced detach whose host never answers goes on without it, and the reconciler unplugs the
        # dead disk once the host is back (a volume's export removed cuts the VM off all the same).
        steps=(Step("host-detach", unplug_from_vm, skippable=lambda ctx: ctx.params.force),
               release,
               Step("mark-detached", mark, ends=True)),
        gives_up=guest_holds_disk,
        on_give_up=detach_ends_busy,
    )


DETACH_VOLUME = detaching("detach-volume", Step("storage-unexport", unexport_volume), mark_detached, exclusive=True)
