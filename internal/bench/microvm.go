package bench

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/spacesbx/space/internal/substrate/microvm"
	"github.com/spacesbx/space/sdk"
)

// The microvm section compares the microvm substrate (template base-vm)
// with the ns substrate (template base) on one platform of two or more
// workers: every figure is measured for both templates with the same
// procedure, interleaved, so the ns figure is the baseline of the microvm
// one.

// Templates of the two sides.
const (
	vmTemplate = "base-vm"
	nsTemplate = "base"
)

// vmSleepArg makes the background process recognisable: after a move,
// /proc/<pid>/cmdline must still read "sleep <vmSleepArg>".
const vmSleepArg = "86399"

// vmFileBytes is the file written into each long-lived sandbox before
// its snapshots and moves.
const vmFileBytes = 1 << 20

// SideResult is one template's figures.
type SideResult struct {
	Template string
	// MemoryMB is what the control plane reports for the sandbox.
	MemoryMB int
	// Create is POST /v2/sandboxes until it answered (the control plane
	// answers after spaced-host verified the guest's identity); Ready adds
	// the first envd call through the edge (a stat) and is boot-to-ready.
	Create, Ready []time.Duration
	Pause, Resume []time.Duration
	// Snapshot is POST /sandboxes/{id}/snapshots of a running sandbox
	// (pause, snapshot, thaw); SnapshotBytes the stored object's size.
	Snapshot      []time.Duration
	SnapshotBytes []int64
	// Migrate is POST /space/v1/sandboxes/{id}/migrate to the other
	// worker; MigrateBytes the size of the snapshot the move carried.
	Migrate      []time.Duration
	MigrateBytes []int64
	// PIDKept counts the moves after which the background sleep was still
	// running with its pid; Restarted those the control plane answered
	// processes_restarted.
	PIDKept, Restarted int
}

// VMResult is the microvm section.
type VMResult struct {
	// Accel is the microvm substrate's accelerator ("kvm" or "tcg").
	Accel string
	// Skipped says why the section did not run (no microvm substrate).
	Skipped string
	// Workers on the platform.
	Workers int
	VM, NS  SideResult
	// Cold is base-vm booted cold (Config.Cold), beside VM's clones.
	Cold SideResult
}

// VMConfig sizes the microvm section.
type VMConfig struct {
	// Creates boot-to-ready samples of base-vm, each followed by NSPerVM of
	// base; once BootBudget has passed, sampling stops after minBootSamples
	// (zero: no budget).
	Creates, NSPerVM int
	BootBudget       time.Duration
	// Rounds pause + same-worker resume pairs per side.
	Rounds int
	// Snapshots per side.
	Snapshots int
	// Moves cross-worker resumes per side.
	Moves int
	// Cold, when set, is a platform whose microVMs boot cold (no template
	// snapshots): each boot sample on the measured platform (a template
	// clone) is followed by one there, the baseline of the clone.
	Cold *Platform
}

// accelLabel is what every microvm figure carries: the accelerator it ran
// on, so TCG figures are never mistaken for KVM ones.
func accelLabel(accel string) string {
	switch accel {
	case "tcg":
		return " (TCG, no KVM)"
	case "kvm":
		return " (KVM)"
	case "":
		return ""
	}
	return " (" + accel + ")"
}

// vmUnavailable says why a platform started without the microvm substrate
// (up.Config's defaults: QEMU at its default path, the guest kernel in
// <BinDir>/../.cache/vm/kernel).
func vmUnavailable(binDir string) string {
	if _, err := os.Stat(microvm.DefaultQEMUPath); err != nil {
		return fmt.Sprintf("no QEMU at %s (make vm-deps)", microvm.DefaultQEMUPath)
	}
	kdir := filepath.Join(filepath.Dir(binDir), ".cache", "vm", "kernel")
	if _, err := os.Stat(filepath.Join(kdir, "vmlinuz")); err != nil {
		return fmt.Sprintf("no guest kernel in %s (make vm-deps)", kdir)
	}
	tmp, err := os.MkdirTemp("", "space-bench-vm-")
	if err != nil {
		return "microvm substrate unavailable"
	}
	defer os.RemoveAll(tmp)
	if _, err := microvm.New(microvm.Config{StateDir: tmp, KernelPath: filepath.Join(kdir, "vmlinuz"), ModulesDir: filepath.Join(kdir, "modules")}); err != nil {
		return err.Error()
	}
	return "the platform started without the microvm substrate"
}

// vmSide is a long-lived sandbox of one template with a 1 MiB file and a
// background sleep in it.
type vmSide struct {
	res    *SideResult
	sbx    *sdk.Sandbox
	pid    int
	worker int // index into Platform.Workers
}

// MeasureVM runs the microvm section on p (two or more workers). A
// platform without the microvm substrate is no error: the result says
// why it was skipped.
func MeasureVM(ctx context.Context, p *Platform, binDir string, c VMConfig, progress func(string, ...any)) (VMResult, error) {
	res := VMResult{Accel: p.VMAccel(), Workers: len(p.Workers), VM: SideResult{Template: vmTemplate}, NS: SideResult{Template: nsTemplate},
		Cold: SideResult{Template: vmTemplate}}
	if res.Accel == "" {
		res.Skipped = vmUnavailable(binDir)
		return res, nil
	}
	if len(p.Workers) < 2 {
		return res, fmt.Errorf("microvm: cross-worker resume needs 2 workers, the platform has %d", len(p.Workers))
	}
	// The long-lived sandboxes first: the first VM builds the guest image
	// (once per platform), which the boot samples must not include.
	progress("microvm (%s): long-lived base-vm and base sandboxes, %d KiB file and a background sleep in each", res.Accel, vmFileBytes>>10)
	var sides []*vmSide
	defer func() {
		for _, s := range sides {
			_ = p.Client.KillSandbox(context.WithoutCancel(ctx), s.sbx.ID)
		}
	}()
	for _, r := range []*SideResult{&res.VM, &res.NS} {
		s, err := newVMSide(ctx, p, r)
		if err != nil {
			return res, fmt.Errorf("%s: %w", r.Template, err)
		}
		sides = append(sides, s)
	}

	// The long-lived sandboxes stay paused while the boot samples run: an
	// idle guest under TCG still costs CPU the creates would share.
	for _, s := range sides {
		if _, err := lifecycleCall(ctx, p, "/sandboxes/"+s.sbx.ID+"/pause", ""); err != nil {
			return res, fmt.Errorf("%s pause: %w", s.res.Template, err)
		}
	}
	progress("microvm: boot-to-ready, %d base-vm creates (budget %v), %d base after each", c.Creates, c.BootBudget, c.NSPerVM)
	t0 := time.Now()
	for i := range c.Creates {
		if !bootMore(i, time.Since(t0), c.BootBudget) {
			break
		}
		if err := bootOnce(ctx, p, &res.VM); err != nil {
			return res, err
		}
		if c.Cold != nil {
			if err := bootOnce(ctx, c.Cold, &res.Cold); err != nil {
				return res, fmt.Errorf("cold: %w", err)
			}
		}
		for range c.NSPerVM {
			if err := bootOnce(ctx, p, &res.NS); err != nil {
				return res, err
			}
		}
	}

	for _, s := range sides {
		if _, err := lifecycleCall(ctx, p, "/v2/sandboxes/"+s.sbx.ID+"/connect", `{"timeout":1800}`); err != nil {
			return res, fmt.Errorf("%s resume: %w", s.res.Template, err)
		}
	}

	progress("microvm: pause + same-worker resume x%d per side", c.Rounds)
	for i := range c.Rounds {
		for _, s := range alternate(sides, i) {
			id := s.sbx.ID
			d, err := lifecycleCall(ctx, p, "/sandboxes/"+id+"/pause", "")
			if err != nil {
				return res, fmt.Errorf("%s pause: %w", s.res.Template, err)
			}
			s.res.Pause = append(s.res.Pause, d)
			d, err = lifecycleCall(ctx, p, "/v2/sandboxes/"+id+"/connect", `{"timeout":1800}`)
			if err != nil {
				return res, fmt.Errorf("%s resume: %w", s.res.Template, err)
			}
			s.res.Resume = append(s.res.Resume, d)
		}
	}

	progress("microvm: snapshot x%d per side", c.Snapshots)
	for i := range c.Snapshots {
		for _, s := range alternate(sides, i) {
			var info struct {
				SnapshotID string `json:"snapshotID"`
			}
			d, err := lifecycleCallOut(ctx, p, "/sandboxes/"+s.sbx.ID+"/snapshots", "{}", &info)
			if err != nil {
				return res, fmt.Errorf("%s snapshot: %w", s.res.Template, err)
			}
			size, err := p.snapshotSize(info.SnapshotID)
			if err != nil {
				return res, fmt.Errorf("%s snapshot: %w", s.res.Template, err)
			}
			s.res.Snapshot = append(s.res.Snapshot, d)
			s.res.SnapshotBytes = append(s.res.SnapshotBytes, size)
		}
	}

	progress("microvm: cross-worker resume x%d per side", c.Moves)
	for i := range c.Moves {
		for _, s := range alternate(sides, i) {
			if err := s.move(ctx, p); err != nil {
				return res, fmt.Errorf("%s move: %w", s.res.Template, err)
			}
		}
	}
	return res, nil
}

// minBootSamples is how many boot samples are taken whatever the budget.
const minBootSamples = 3

// bootMore says whether boot sample i (from 0) is taken after elapsed of
// sampling with budget (zero: unlimited).
func bootMore(i int, elapsed, budget time.Duration) bool {
	return i < minBootSamples || budget <= 0 || elapsed < budget
}

// alternate returns sides in order on even i and reversed on odd i, so
// neither side always runs first.
func alternate[T any](sides []T, i int) []T {
	out := make([]T, len(sides))
	for j := range sides {
		if i%2 == 0 {
			out[j] = sides[j]
		} else {
			out[j] = sides[len(sides)-1-j]
		}
	}
	return out
}

func createOpts(template string) sdk.CreateOptions {
	// Secure: POST /v2/sandboxes, as the e2b SDKs create.
	return sdk.CreateOptions{Template: template, Secure: true, Timeout: 30 * time.Minute}
}

// bootOnce creates a sandbox, times it until the first envd call through
// the edge answered, and kills it (untimed).
func bootOnce(ctx context.Context, p *Platform, r *SideResult) error {
	t0 := time.Now()
	sbx, err := p.Client.CreateSandbox(ctx, createOpts(r.Template))
	created := time.Since(t0)
	if err != nil {
		return fmt.Errorf("create %s: %w", r.Template, err)
	}
	defer p.Client.KillSandbox(context.WithoutCancel(ctx), sbx.ID)
	if _, err := sbx.Stat(ctx, "/"); err != nil {
		return fmt.Errorf("%s: first envd call: %w", r.Template, err)
	}
	ready := time.Since(t0)
	r.Create = append(r.Create, created)
	r.Ready = append(r.Ready, ready)
	return nil
}

func newVMSide(ctx context.Context, p *Platform, r *SideResult) (*vmSide, error) {
	sbx, err := p.Client.CreateSandbox(ctx, createOpts(r.Template))
	if err != nil {
		return nil, fmt.Errorf("create: %w", err)
	}
	s := &vmSide{res: r, sbx: sbx, worker: -1}
	if info, err := p.Client.GetSandbox(ctx, sbx.ID); err == nil {
		r.MemoryMB = info.MemoryMB
	}
	data := make([]byte, vmFileBytes)
	_, _ = rand.Read(data)
	if _, err := sbx.WriteFile(ctx, "/home/user/bench-1m.bin", data); err != nil {
		_ = sbx.Kill(context.WithoutCancel(ctx))
		return nil, fmt.Errorf("write: %w", err)
	}
	out, err := runOut(ctx, sbx, "setsid sleep "+vmSleepArg+" </dev/null >/dev/null 2>&1 & echo $!")
	if err == nil {
		s.pid, err = strconv.Atoi(strings.TrimSpace(out))
	}
	if err != nil {
		_ = sbx.Kill(context.WithoutCancel(ctx))
		return nil, fmt.Errorf("background sleep: %q: %w", out, err)
	}
	for i, w := range p.Workers {
		if _, _, ok := w.Manager().BridgePID(sbx.ID); ok {
			s.worker = i
		}
	}
	if s.worker < 0 {
		_ = sbx.Kill(context.WithoutCancel(ctx))
		return nil, fmt.Errorf("sandbox %s runs on no worker of the platform", sbx.ID)
	}
	return s, nil
}

// move migrates the sandbox to the next worker and checks whether the
// background sleep survived.
func (s *vmSide) move(ctx context.Context, p *Platform) error {
	next := (s.worker + 1) % len(p.Workers)
	target := fmt.Sprintf("w%d", next+1) // up names workers w1..wN in order
	var ans struct {
		SnapshotID         string `json:"snapshot_id"`
		ProcessesRestarted bool   `json:"processes_restarted"`
		Route              struct {
			WorkerID string `json:"worker_id"`
		} `json:"route"`
	}
	d, err := lifecycleCallOut(ctx, p, "/space/v1/sandboxes/"+s.sbx.ID+"/migrate", `{"target_worker":"`+target+`"}`, &ans)
	if err != nil {
		return err
	}
	s.worker = next
	s.res.Migrate = append(s.res.Migrate, d)
	if size, err := p.snapshotSize(ans.SnapshotID); err == nil {
		s.res.MigrateBytes = append(s.res.MigrateBytes, size)
	}
	if ans.ProcessesRestarted {
		s.res.Restarted++
	}
	out, err := runOut(ctx, s.sbx, fmt.Sprintf("tr '\\0' ' ' </proc/%d/cmdline 2>/dev/null; true", s.pid))
	if err != nil {
		return fmt.Errorf("after the move: %w", err)
	}
	if strings.TrimSpace(out) == "sleep "+vmSleepArg {
		s.res.PIDKept++
	}
	return nil
}

// snapshotSize is the size of snapshot id in the platform's store.
func (p *Platform) snapshotSize(id string) (int64, error) {
	if id == "" || strings.ContainsAny(id, "/.") {
		return 0, fmt.Errorf("snapshot id %q", id)
	}
	fi, err := os.Stat(filepath.Join(p.DataDir, "snapshots", id))
	if err != nil {
		return 0, err
	}
	return fi.Size(), nil
}

// runOut runs cmd and returns its stdout; a non-zero exit is an error.
func runOut(ctx context.Context, sbx *sdk.Sandbox, cmd string) (string, error) {
	var out, errb bytes.Buffer
	code, err := sbx.Run(ctx, cmd, sdk.RunOptions{Stdout: &out, Stderr: &errb})
	if err == nil && code != 0 {
		err = fmt.Errorf("exit %d: %s", code, bytes.TrimSpace(errb.Bytes()))
	}
	return out.String(), err
}

func mibBytes(b float64) float64 { return b / (1 << 20) }

func medianBytes(bs []int64) float64 {
	xs := make([]float64, len(bs))
	for i, b := range bs {
		xs[i] = float64(b)
	}
	return Median(xs)
}

// Rows renders the section: each microvm figure beside the ns one.
func (r VMResult) Rows() []Row {
	if r.Skipped != "" {
		return []Row{{Figure: "microvm (base-vm) vs ns (base)", Value: "skipped: " + r.Skipped}}
	}
	l := accelLabel(r.Accel)
	vm, ns := r.VM, r.NS
	p50 := func(fig string, v, n []time.Duration) Row {
		a, b := Median(ms(v)), Median(ms(n))
		return Row{fmt.Sprintf("microvm %s p50, n=%d (ms)%s", fig, len(v), l), fmt.Sprintf("%.1f", a),
			fmt.Sprintf("%.1f ns, n=%d", b, len(n)), ratio(a, b), "", NotJudged}
	}
	sv, sn := medianBytes(vm.SnapshotBytes), medianBytes(ns.SnapshotBytes)
	guest := "VM"
	if vm.MemoryMB > 0 {
		guest = fmt.Sprintf("%d MiB VM", vm.MemoryMB)
	}
	rows := []Row{p50("boot-to-ready (template clone)", vm.Ready, ns.Ready)}
	if len(r.Cold.Ready) > 0 {
		a, b := Median(ms(vm.Ready)), Median(ms(r.Cold.Ready))
		// Targets: a clone at most 1/5 of a cold boot; under TCG at most
		// 600 ms, under KVM at most 150 ms.
		limit := 600.0
		if r.Accel == "kvm" {
			limit = 150
		}
		v := atMost(a, b/5)
		if v == Meets {
			v = atMost(a, limit)
		}
		rows = append(rows, Row{fmt.Sprintf("microvm create p50 (request to first envd answer), template clone vs cold boot, n=%d (ms)%s", len(vm.Ready), l),
			fmt.Sprintf("%.1f", a), fmt.Sprintf("%.1f cold, n=%d", b, len(r.Cold.Ready)), ratio(a, b),
			fmt.Sprintf("<= 1/5 cold and <= %.0f ms", limit), v})
	}
	return append(rows, []Row{
		p50("pause", vm.Pause, ns.Pause),
		p50("same-worker resume", vm.Resume, ns.Resume),
		{fmt.Sprintf("microvm snapshot size, %s + 1 MiB file (MiB)%s", guest, l), fmt.Sprintf("%.1f", mibBytes(sv)),
			fmt.Sprintf("%.2f ns layer + 1 MiB file", mibBytes(sn)), ratio(sv, sn), "", NotJudged},
		p50("snapshot time", vm.Snapshot, ns.Snapshot),
		p50("cross-worker resume", vm.Migrate, ns.Migrate),
		{fmt.Sprintf("microvm background sleep kept its pid, moves%s", l), fmt.Sprintf("%d/%d", vm.PIDKept, len(vm.Migrate)),
			fmt.Sprintf("%d/%d ns", ns.PIDKept, len(ns.Migrate)), "", "", NotJudged},
	}...)
}

// Notes explains the section.
func (r VMResult) Notes() string {
	if r.Skipped != "" {
		return "microvm: skipped: " + r.Skipped + "\n"
	}
	var b strings.Builder
	vm, ns := r.VM, r.NS
	fmt.Fprintf(&b, "microvm: template base-vm (microvm substrate, accelerator %s) vs base (ns substrate), same platform (%d workers), same procedure, interleaved.\n", r.Accel, r.Workers)
	if r.Accel == "tcg" {
		b.WriteString("  TCG: QEMU emulates the CPU (no /dev/kvm here); microvm figures are not representative of KVM.\n")
	}
	if len(r.Cold.Ready) > 0 {
		fmt.Fprintf(&b, "  base-vm sandboxes are clones of a template snapshot (booted once per worker, RAM mapped copy-on-write); the cold\n"+
			"  baseline boots each VM from the kernel on a second platform with templates off, interleaved with the clones.\n")
	}
	fmt.Fprintf(&b, "  boot-to-ready = POST /v2/sandboxes until the first envd call through the edge (a stat) answered; the create alone\n"+
		"  (which answers after spaced-host verified the guest) p50 %.1f ms microvm, %.1f ms ns. Each sandbox killed after (untimed).\n",
		Median(ms(vm.Create)), Median(ms(ns.Create)))
	fmt.Fprintf(&b, "  pause/resume/snapshot/move: one long-lived sandbox per side with a %d KiB random file and a background `sleep %s`;\n"+
		"  snapshot = POST /sandboxes/{id}/snapshots while running (pause, snapshot, thaw), size = the stored object (microvm: memory state;\n"+
		"  ns: writable-layer archive); cross-worker resume = POST /space/v1/sandboxes/{id}/migrate to the other worker.\n",
		vmFileBytes>>10, vmSleepArg)
	if len(vm.MigrateBytes) > 0 || len(ns.MigrateBytes) > 0 {
		fmt.Fprintf(&b, "  snapshot carried by a move, median: %.1f MiB microvm, %.2f MiB ns; control plane answered processes_restarted on %d/%d microvm moves, %d/%d ns moves.\n",
			mibBytes(medianBytes(vm.MigrateBytes)), mibBytes(medianBytes(ns.MigrateBytes)), vm.Restarted, len(vm.Migrate), ns.Restarted, len(ns.Migrate))
	}
	return b.String()
}
