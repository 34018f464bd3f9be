"""Commands shared by every worker of a mesh (protocol 1.7): one command object per instruction, not per worker.

An instruction that runs alike on every device of a mesh would otherwise be one command per worker, differing
only in the devices each worker hosts: at 64 workers, 64 structs per instruction for the controller to build.
Torch-free: the controller writes these, the workers (and the simulator) read them.

Rules:
  1. A shared command names its mesh (`CmdRun.mesh`, `CmdDelete.mesh` >= 0) and no devices (`devices` empty); it
     is the same object, and the same bytes, in the batch of every worker hosting a device of that mesh.
  2. Before the first shared command of a mesh, each worker's batch holds a `CmdMesh(mesh, devices)`: that
     worker's logical devices of the mesh. It holds for the rest of its batch (a replay's commands included: a
     program keeps its CmdMesh among its commands), never beyond: each batch says it again, so a batch means the
     same whatever ran before it (a device that moved, a rebuild).
  3. A reader turns a shared command into this worker's own (`Meshes.local`: the command with its devices, as a
     1.6 controller would have sent it) before anything else looks at it: runs, memory caps, profiles and
     metrics see ordinary commands. A shared command whose mesh no earlier CmdMesh of the batch named is
     refused with one line (`ValueError`).
  4. A command with `mesh` -1 names its own devices, as before 1.7.
"""

from __future__ import annotations

from msgspec.structs import replace

from dtorch_protocol import messages as m


class Meshes:
    """The CmdMesh declarations of one batch, read in order (rules 2-3)."""

    __slots__ = ("_devices",)

    def __init__(self) -> None:
        self._devices: dict[int, list[int]] = {}

    def local(self, cmd: m.Cmd) -> m.Cmd | None:
        """`cmd` as this worker's own command, or None for a CmdMesh (noted here, nothing to run)."""
        t = type(cmd)
        if t is m.CmdMesh:
            self._devices[cmd.mesh] = cmd.devices
            return None
        if (t is m.CmdRun or t is m.CmdDelete) and cmd.mesh >= 0:
            devices = self._devices.get(cmd.mesh)
            if devices is None:
                raise ValueError(f"a shared {'run of ' + cmd.op if t is m.CmdRun else 'delete'} names mesh "
                                 f"{cmd.mesh}, but no CmdMesh before it in this batch said which of its devices "
                                 "are on this worker")
            return replace(cmd, devices=devices, mesh=-1)
        return cmd
