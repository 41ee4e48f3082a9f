package up

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	"github.com/spacesbx/space/internal/guest"
	"github.com/spacesbx/space/internal/sbxmanager"
	"github.com/spacesbx/space/internal/snapshot"
	"github.com/spacesbx/space/internal/store"
	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/substrate/microvm"
	"github.com/spacesbx/space/internal/substrate/ns"
	"github.com/spacesbx/space/internal/worker"
)

// RunNode is space-node: one worker (node-api + sbx-manager over the ns
// substrate, and microvm with --vm-kernel-dir) joined to an existing control plane's etcd.
func RunNode(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("space-node", flag.ContinueOnError)
	fs.SetOutput(stderr)
	id := fs.String("id", "", "worker id (required)")
	addr := fs.String("addr", "127.0.0.1:0", "node-api listen address")
	dataDir := fs.String("data-dir", "", "worker state directory (required)")
	etcd := fs.String("etcd-endpoints", "", "comma-separated etcd endpoints of the control plane (required)")
	binDir := fs.String("bin-dir", "", "directory of spaced-host and spaced-guest (default: next to this binary)")
	snapDir := fs.String("snapshot-dir", "", "snapshot store shared by all workers (required for resume on another worker)")
	vmKernel := fs.String("vm-kernel-dir", "", "microvm guest kernel dir with vmlinuz and modules/ (make vm-deps); empty: ns only")
	capacity := fs.Int("capacity", 100, "sandboxes the scheduler may place on this worker (each idle ns sandbox holds about 13 host tasks against kernel.pid_max; a warning says when the host cannot hold them)")
	noUserNS := fs.Bool("no-user-namespaces", false, "run ns sandboxes without user namespaces (root in a sandbox is then host root for uid checks)")
	noQuota := fs.Bool("no-disk-quota", false, "keep ns sandboxes' writable layers in plain directories (no per-sandbox disk quota)")
	vmAccel := fs.String("vm-accel", "", "force the microvm accelerator, kvm or tcg (default: probe kvm, then tcg)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *id == "" || *dataDir == "" || *etcd == "" || *snapDir == "" {
		fmt.Fprintln(stderr, "space-node: --id, --data-dir, --etcd-endpoints and --snapshot-dir are required")
		return 2
	}
	if *binDir == "" {
		exe, _ := os.Executable()
		*binDir = filepath.Dir(exe)
	}
	if *capacity <= 0 {
		fmt.Fprintln(stderr, "space-node: --capacity must be positive")
		return 2
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	if short := worker.PidBudget(*capacity); short != "" {
		log.Warn("host task limits below capacity: sandboxes past them fail to start", "capacity", *capacity, "limits", short)
	}
	st, err := store.Open(ctx, store.Config{Endpoints: strings.Split(*etcd, ","), Logger: log})
	if err != nil {
		fmt.Fprintf(stderr, "space-node: %v\n", err)
		return 1
	}
	defer st.Close()
	sub, err := ns.New(ns.Config{StateDir: filepath.Join(*dataDir, "ns"), InitPath: NSInitPath(*binDir), Logger: log,
		NoUserNamespaces: *noUserNS, NoDiskQuota: *noQuota})
	if err != nil {
		fmt.Fprintf(stderr, "space-node: %v\n", err)
		return 1
	}
	defer sub.Close()
	var extra []substrate.Substrate
	if *vmKernel != "" {
		vm, err := microvm.New(microvm.Config{StateDir: filepath.Join(*dataDir, "microvm"),
			KernelPath: filepath.Join(*vmKernel, "vmlinuz"), ModulesDir: filepath.Join(*vmKernel, "modules"), Accel: *vmAccel, Logger: log})
		if err != nil {
			fmt.Fprintf(stderr, "space-node: %v\n", err)
			return 1
		}
		defer vm.Close()
		extra = append(extra, vm)
	}
	snaps, err := snapshot.NewLocal(*snapDir)
	if err != nil {
		fmt.Fprintf(stderr, "space-node: %v\n", err)
		return 1
	}
	w, err := worker.New(worker.Config{
		ID: *id, Addr: *addr, StateDir: filepath.Join(*dataDir, "worker"), Capacity: *capacity, Logger: log,
		Manager: sbxmanager.Config{
			SpacedHostPath: filepath.Join(*binDir, "spaced-host"), AgentPath: filepath.Join(*binDir, "spaced-guest"),
			EnvdVersion: guest.EnvdVersion,
		},
	}, worker.Deps{Substrates: append([]substrate.Substrate{sub}, extra...), Registrar: registrar{st}, Bundles: st, Sandboxes: sandboxWatch{st}, Snapshots: snaps})
	if err != nil {
		fmt.Fprintf(stderr, "space-node: %v\n", err)
		return 1
	}
	fmt.Fprintf(stdout, "space-node %s: node-api %s\n", *id, w.URL())
	if err := w.Run(ctx); err != nil {
		fmt.Fprintf(stderr, "space-node: %v\n", err)
		return 1
	}
	return 0
}
