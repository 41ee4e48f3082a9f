// Package microvm is the SPACE substrate that runs every sandbox in its own
// QEMU "microvm" virtual machine (DESIGN.md section 10): a guest kernel of
// its own, a full memory snapshot for pause-and-move, and the same request
// path as the ns substrate (spaced-host -> a Unix socket -> spaced-guest).
//
// # The machine
//
// qemu-system-x86_64 -M microvm (the accelerator whose probe guest boots
// first, KVM then TCG, see probe.go: -cpu host or -cpu max), -nodefaults -no-user-config,
// no host device: the only devices are the ISA serial console (to
// Spec.Dir/console.log), a virtio-serial port named PortName (the agent's
// channel), one virtio-net NIC (see "The network"), an image VM's two
// virtio-blk disks (see "Image VMs") and, under TCG, the
// PIT, PIC and RTC the kernel needs to
// calibrate its clocks (without the PIT a loaded TCG host can stall the
// boot in delay-loop calibration; the kernel is also told the host's TSC
// frequency, see hostTSCKHz). vCPUs = ceil(CPUMillis/1000), memory =
// MemoryBytes (default 256 MiB, minimum 128 MiB). The exact command line is
// built by qemuArgs. The kernel reboots by triple fault (reboot=t): a
// panic (panic=-1) or a reboot resets the vCPU, which -no-reboot turns
// into QEMU exiting, so Done closes. (The default reboot sequence ends, on
// microvm, in a jump to the firmware, which boots the kernel again behind
// QEMU's back and hangs.)
//
// The guest boots the kernel (Config.KernelPath) with an initramfs the
// substrate builds itself on first use and caches under
// StateDir/images/<sha256 of every input>.cpio.gz: static busybox, the
// virtio and fw_cfg modules, the agent at /.space/spaced-guest and a
// busybox sh /init (see initScript) that mounts proc, sys, devtmpfs,
// devpts and tmpfs /tmp, /run and /dev/shm, loads the modules, brings lo up
// and execs the agent as pid 1 with SPACE_GUEST_VM_PORT=space.0 plus
// Spec.AgentEnv. Spec.AgentEnv travels as a fw_cfg item (not on the
// command line: it is too small and world-readable); the init copies it
// and unloads the fw_cfg driver. /bin/bash execs busybox sh (the e2b SDK runs
// "/bin/bash -l -c"); accounts are root and user (uid 1000).
//
// Spec.Template is not interpreted: a VM without Spec.Image runs this one
// userland (the control plane names it, e.g. "base-vm").
//
// # Image VMs
//
// A VM whose Spec.Image is set boots that root file system instead (the
// same layer stack the ns substrate mounts): rootdisk.go flattens the
// layers once per Image.ID into a read-only ext4 disk cached in
// Config.RootDiskDir (machine-wide, /var/cache/space/vm-images), shared by
// every VM of the image (virtio-blk, readonly=on, a read-only descriptor);
// layerdisk.go gives each sandbox a writable layer disk
// (Spec.Dir/layer.img, Limits.DiskBytes, default 4 GiB, sparse). The same
// initramfs boots with space.root=disk: the init loads the block, ext4 and
// overlay modules (order.disk, resolved like the others), mounts
// overlay(lower = the image, upper = the layer disk) and switch_roots into
// it with the agent (still the platform's, bound read-only at
// /run/space/spaced-guest) as pid 1. Files then live on the layer disk, not
// in guest memory: they survive Stop (a Start on the same directory boots
// on them; Stop is a power cut, so what the guest had not written back is
// lost, as on any VM), and a saved state carries the layer disk along.
// They also survive QEMU's death: SaveLayer (layersave.go) saves the disk
// of an ended VM as a layer state, which Start boots cold on (the
// substrate.LayerSaver recovery of a lost execution). QEMU holds the
// disk's OFD write lock through the descriptor it inherits, so no second
// VM boots on it and no save reads it while QEMU lives.
//
// # The network
//
// Every VM, templates included, has one virtio-net NIC (-netdev
// tap,fd=N -device virtio-net-device): the device set must be the same
// for a template and its clones and for a saved state and its restore.
// Its backend is Spec.Network.Tap, a tap the caller made in the worker's
// egress network namespace (passed as a descriptor; QEMU keeps it, so an
// adopted VM keeps its link), with Spec.Network.MAC. Without
// Spec.Network the backend is a throwaway tap in a network namespace of
// its own, where nothing else lives, and the MAC a fixed one (without
// root, no backend at all). The guest agent configures the NIC at every
// activation (address, route, resolver, CA, and the MAC: a clone keeps
// the template's; see internal/guest); the init only loads its driver.
// See tap.go for why every tap is a plain IFF_TAP|IFF_NO_PI one.
//
// # Files live in guest memory (VMs without an image)
//
// The root file system is the initramfs itself (a tmpfs-like rootfs in
// guest RAM); there is no disk. Everything a sandbox writes is therefore
// part of its memory, and a memory snapshot (SaveState) carries files and
// processes together. The flip side: files count against MemoryBytes, and
// nothing survives Stop except through SaveState. Spec.Dir holds no
// writable layer.
//
// # Activation directory (Spec.Dir)
//
//	guest.sock   the agent channel's listening socket (removed by Stop)
//	qmp.sock     QEMU's QMP listening socket, mode 0600 (removed by Stop)
//	vm.json      the adoption state (adopt.go; removed by Stop)
//	console.log  the guest's serial console and QEMU's messages, capped at
//	             4 MiB, while the process that started QEMU runs (kept;
//	             Start errors quote its tail)
//	layer.img    an image VM's writable layer disk (kept: the sandbox's
//	             files; OFD-locked by its QEMU)
//
// # Host side of the channel
//
// The substrate binds and listens on guest.sock itself and hands the
// listening socket to QEMU as an inherited descriptor (-chardev
// socket,fd=3,server=on); QEMU calls listen() on it again, so the
// listener's credentials (what a client reads with SO_PEERCRED) are
// QEMU's, the listener lives in QEMU's descriptor table and the substrate
// closes its copy: spaced-host can tie the socket to InitPID() exactly as
// it ties the ns substrate's socket to the agent. QMP is set up the same
// way on qmp.sock (QEMU's fd 4), which only root can reach: QEMU accepts
// one client at a time and the next once it goes, so the worker process
// that adopts a running QEMU connects again (adopt.go).
//
// # Least privilege
//
// QEMU runs with -sandbox on,obsolete=deny,elevateprivileges=deny,
// spawn=deny,resourcecontrol=deny (its own seccomp filter: no exec, no
// set*id, no scheduler/affinity changes). When the substrate runs as root,
// QEMU is started directly as an unprivileged uid of its own (uid = gid,
// one per running instance from [UIDFirst, UIDFirst+UIDCount), leased by
// an flock; no supplementary groups except Config.KVMGroup under KVM), so
// two QEMUs can neither signal nor ptrace each other and none can read
// another's activation directory. QEMU's -runas is not used: QEMU 7.2
// installs its seccomp filter before it drops privileges, so -runas with
// elevateprivileges=deny dies with SIGSYS. Every file QEMU needs is opened
// by the substrate and passed as a descriptor (the kernel, the image and
// the environment as /proc/self/fd/N, a memfd for the environment; an
// image VM's disks as -add-fd fd sets, the root disk read-only only; the
// migration stream through QMP getfd), so QEMU needs no access to any host
// directory or file (root disks are 0400 root, layer disks 0600 root). No mount or pid namespace: QEMU under its own uid, its
// seccomp filter and no host devices is the boundary that matters, and a
// namespace set-up would add a re-exec like the ns substrate's for little.
// A sandbox's QEMU outlives the worker process (a session of its own, no
// parent-death signal; see adopt.go); probe and template QEMUs die with it
// (parent-death signal, forked from one dedicated locked OS thread).
//
// # Pause, state and restore
//
// Pause is QMP stop (vCPUs halted, same QEMU process), Resume is cont.
// SaveState (paused instances only) writes a small header (format version,
// memory, vCPUs, CPU model, accelerator, image id; for an image VM the root
// disk's image id and SHA-256, then the layer disk's data extents, see
// layerdisk.go) followed by QEMU's migration stream (QMP migrate to a pipe passed with getfd: fd: migration,
// because spawn=deny rules out exec:). A Start with Spec.RestoreState
// checks the header against what this substrate would run (same image id,
// so the same kernel, modules, busybox and agent; same CPU model; the
// spec's limits, when set, must give the same shape; for an image VM the
// same root disk bytes: guest memory caches its blocks), writes the layer
// disk into the new directory, launches the same
// command line with -incoming fd:N on the state file, waits for the
// migration to complete and continues the guest: its processes go on
// where they stopped. The guest keeps the identity it had; spaced-host
// re-activates it over the channel.
//
// # Known limits
//
//   - Guest time stops while the VM is paused or saved: after Resume or a
//     restore the guest's clock is behind by the pause (measured: 5 s
//     pause, guest 5 s behind). The guest's RTC (/dev/rtc0) follows the
//     host's clock throughout, so the agent can resynchronize (it does
//     not yet).
//   - KVM (-cpu host) boots only where a probe guest boots: a paravirtual
//     KVM (kvm_pvm) that runs only PVM-built guest kernels fails the probe
//     and TCG is used. QEMU reaches /dev/kvm through a POSIX ACL entry for
//     Config.KVMGroup, its only supplementary group (kvmacl.go).
//   - Pids limits are not enforced (the guest kernel is the boundary); no
//     disk: files count against guest memory.
//   - A restore needs the identical image on the target (same kernel,
//     modules, busybox and agent build); cached images are never removed.
//     An image VM's state also needs the identical root disk: mke2fs does
//     not promise the same bytes on another host, so a move between hosts
//     that flattened the image apart is refused (ErrConflict) until root
//     disks travel with states or come from a shared store.
//   - Stop is a power cut for an image VM's layer disk (see "Image VMs");
//     Spec.Volumes are refused (ErrInvalid); Image.Env, WorkingDir and
//     User are not applied by the substrate (the agent's configuration
//     carries process defaults).
package microvm
