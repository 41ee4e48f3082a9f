package bench

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/spacesbx/space/sdk"
)

// IdleVMResult is the host memory of idle base-vm sandboxes (template
// clones) on one worker: per sandbox, QEMU's and spaced-host's PSS (the
// clones' shared template pages are divided among them), and what the
// template's pages account for.
type IdleVMResult struct {
	Accel string
	N     int
	// PSS is QEMU + spaced-host per sandbox (bytes); QEMUPSS and HostPSS
	// its parts; ShmemPSS QEMU's share of the template's (shmem) pages;
	// SharedRSS the resident pages QEMU shares with other processes, and
	// RSS its whole resident set.
	PSS, QEMUPSS, HostPSS, ShmemPSS, SharedRSS, RSS []float64
	// MemoryMB is the guest memory of each sandbox.
	MemoryMB int
	Settle   time.Duration
}

// MeasureIdleVMs creates n base-vm sandboxes on p (one worker), lets them
// settle and reads each one's QEMU and spaced-host smaps_rollup.
func MeasureIdleVMs(ctx context.Context, p *Platform, n int, progress func(string, ...any)) (IdleVMResult, error) {
	res := IdleVMResult{Accel: p.VMAccel(), N: n, Settle: 10 * time.Second}
	var ids []string
	defer func() {
		for _, id := range ids {
			_ = p.Client.KillSandbox(context.WithoutCancel(ctx), id)
		}
	}()
	t0 := time.Now()
	for i := range n {
		sbx, err := p.Client.CreateSandbox(ctx, sdk.CreateOptions{Template: vmTemplate, Secure: true, Timeout: 30 * time.Minute})
		if err != nil {
			return res, fmt.Errorf("create %d of %d: %w", i+1, n, err)
		}
		ids = append(ids, sbx.ID)
		if i == 0 {
			if info, err := p.Client.GetSandbox(ctx, sbx.ID); err == nil {
				res.MemoryMB = info.MemoryMB
			}
		}
	}
	progress("microvm: %d idle base-vm created in %s; settling %s", n, time.Since(t0).Round(time.Second), res.Settle)
	select {
	case <-ctx.Done():
		return res, ctx.Err()
	case <-time.After(res.Settle):
	}
	for _, id := range ids {
		host, qemu, ok := p.BridgePID(id)
		if !ok {
			return res, fmt.Errorf("sandbox %s: no bridge", id)
		}
		q, err := rollup(qemu)
		if err != nil {
			return res, err
		}
		h, err := rollup(host)
		if err != nil {
			return res, err
		}
		res.QEMUPSS = append(res.QEMUPSS, q["Pss"])
		res.HostPSS = append(res.HostPSS, h["Pss"])
		res.PSS = append(res.PSS, q["Pss"]+h["Pss"])
		res.ShmemPSS = append(res.ShmemPSS, q["Pss_Shmem"])
		res.SharedRSS = append(res.SharedRSS, q["Shared_Clean"]+q["Shared_Dirty"])
		res.RSS = append(res.RSS, q["Rss"])
	}
	return res, nil
}

// rollup reads /proc/<pid>/smaps_rollup's kB fields, in bytes.
func rollup(pid int) (map[string]float64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/smaps_rollup")
	if err != nil {
		return nil, err
	}
	out := map[string]float64{}
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) == 3 && f[2] == "kB" {
			v, _ := strconv.ParseFloat(f[1], 64)
			out[strings.TrimSuffix(f[0], ":")] = v * 1024
		}
	}
	return out, nil
}

// Rows renders the idle-VM figure: PSS per sandbox against the guest's
// memory size (what a VM without shared template pages would hold at
// most), target 64 MiB.
func (r IdleVMResult) Rows() []Row {
	l := accelLabel(r.Accel)
	pss := mibBytes(Median(r.PSS))
	guest := float64(r.MemoryMB)
	return []Row{{
		fmt.Sprintf("microvm idle base-vm host memory per sandbox, PSS QEMU+spaced-host, n=%d on one worker (MiB)%s", r.N, l),
		fmt.Sprintf("%.1f", pss), fmt.Sprintf("%.0f guest RAM", guest), ratio(pss, guest), "<= 64 MiB", atMost(pss, 64),
	}}
}

// Notes explains the idle-VM figure.
func (r IdleVMResult) Notes() string {
	return fmt.Sprintf("microvm idle: %d base-vm sandboxes (%d MiB guests, template clones) on one worker, %s after the last create; medians in MiB:\n"+
		"  QEMU PSS %.1f (of which the template's shared pages %.1f; QEMU RSS %.1f, %.1f of it shared with other processes) + spaced-host PSS %.1f.\n",
		r.N, r.MemoryMB, r.Settle, mibBytes(Median(r.QEMUPSS)), mibBytes(Median(r.ShmemPSS)), mibBytes(Median(r.RSS)),
		mibBytes(Median(r.SharedRSS)), mibBytes(Median(r.HostPSS)))
}
