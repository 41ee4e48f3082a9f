//go:build linux

package microvm

import (
	"errors"
	"net"
	"os"
	"runtime"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/testenv"
)

// ioctlTUNGETDEVNETNS is _IO('T', 227): a descriptor of the network
// namespace a tun/tap device is in.
const ioctlTUNGETDEVNETNS = 0x54e3

// interfacesIn lists the interface names of the network namespace nsfd.
func interfacesIn(t *testing.T, nsfd int) []string {
	t.Helper()
	type result struct {
		names []string
		err   error
	}
	c := make(chan result, 1)
	go func() { // sends once its thread is back
		names, err := interfacesOnThisThread(nsfd)
		c <- result{names, err}
	}()
	r := <-c
	if r.err != nil {
		t.Fatal(r.err)
	}
	return r.names
}

// interfacesOnThisThread moves the locked thread into nsfd, lists, and
// moves it back (or leaves it locked, to end with its goroutine).
func interfacesOnThisThread(nsfd int) ([]string, error) {
	runtime.LockOSThread()
	orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		runtime.UnlockOSThread()
		return nil, err
	}
	defer unix.Close(orig)
	if err := unix.Setns(nsfd, unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return nil, err
	}
	defer func() {
		if unix.Setns(orig, unix.CLONE_NEWNET) == nil {
			runtime.UnlockOSThread()
		}
	}()
	ifs, err := net.Interfaces()
	var names []string
	for _, i := range ifs {
		names = append(names, i.Name)
	}
	slices.Sort(names)
	return names, err
}

func TestThrowawayTapIsAlone(t *testing.T) {
	testenv.RequireRoot(t, "creates network namespaces")
	tap, err := throwawayTap()
	if err != nil {
		t.Fatal(err)
	}
	defer tap.Close()
	if err := checkNetwork(&substrate.Network{Tap: tap, MAC: defaultMAC}); err != nil {
		t.Fatalf("the substrate's own tap fails its check: %v", err)
	}
	nsfd, err := unix.IoctlRetInt(int(tap.Fd()), ioctlTUNGETDEVNETNS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(nsfd)
	var tapNS, ours unix.Stat_t
	if err := unix.Fstat(nsfd, &tapNS); err != nil {
		t.Fatal(err)
	}
	// The namespace of the test's thread, as every thread's is: the one
	// that made the tap went back to it.
	runtime.LockOSThread()
	err = unix.Stat("/proc/thread-self/ns/net", &ours)
	runtime.UnlockOSThread()
	if err != nil {
		t.Fatal(err)
	}
	if tapNS.Ino == ours.Ino {
		t.Fatal("the throwaway tap is in the test's network namespace")
	}
	if got := interfacesIn(t, nsfd); !slices.Equal(got, []string{"lo", "tap0"}) {
		t.Fatalf("the tap's namespace holds %v, want lo and tap0 only", got)
	}
	// Each VM gets a namespace of its own.
	tap2, err := throwawayTap()
	if err != nil {
		t.Fatal(err)
	}
	defer tap2.Close()
	ns2, err := unix.IoctlRetInt(int(tap2.Fd()), ioctlTUNGETDEVNETNS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(ns2)
	var st2 unix.Stat_t
	if err := unix.Fstat(ns2, &st2); err != nil {
		t.Fatal(err)
	}
	if st2.Ino == tapNS.Ino {
		t.Fatal("two throwaway taps share a namespace")
	}
	// No thread of this process stayed in a tap's namespace.
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Fatal(err)
	}
	for _, task := range tasks {
		var st unix.Stat_t
		if err := unix.Stat("/proc/self/task/"+task.Name()+"/ns/net", &st); err != nil {
			continue // the thread ended
		}
		if st.Ino != ours.Ino {
			t.Errorf("thread %s is in network namespace %d, not the process's %d", task.Name(), st.Ino, ours.Ino)
		}
	}
}

func TestCheckNetworkRejects(t *testing.T) {
	testenv.RequireRoot(t, "creates tap devices")
	open := func(flags uint16) *os.File {
		f, err := tapInNewNetns(flags)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		return f
	}
	good := open(unix.IFF_TAP | unix.IFF_NO_PI)
	if err := checkNetwork(&substrate.Network{Tap: good, MAC: net.HardwareAddr{2, 0, 0, 0, 0, 1}}); err != nil {
		t.Fatalf("good tap: %v", err)
	}
	if err := checkNetwork(&substrate.Network{Tap: good}); err != nil {
		t.Fatalf("good tap, no MAC: %v", err)
	}
	if err := checkNetwork(nil); err != nil {
		t.Fatalf("no network: %v", err)
	}
	regular, err := os.CreateTemp(t.TempDir(), "not-a-tap")
	if err != nil {
		t.Fatal(err)
	}
	defer regular.Close()
	unattached, err := os.OpenFile(tunDevice, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unattached.Close()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	spec := substrate.Spec{Route: testRoute("n1"), Dir: t.TempDir(), AgentPath: exe, Network: &substrate.Network{Tap: good}}
	if err := validateSpec(&spec); err != nil {
		t.Fatalf("validateSpec with a good tap: %v", err)
	}
	for name, n := range map[string]*substrate.Network{
		"no tap":          {MAC: defaultMAC},
		"multicast mac":   {Tap: good, MAC: net.HardwareAddr{1, 0, 0x5e, 0, 0, 1}},
		"short mac":       {Tap: good, MAC: net.HardwareAddr{2, 0, 0}},
		"regular file":    {Tap: regular},
		"unattached tun":  {Tap: unattached},
		"vnet header":     {Tap: open(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)},
		"tun, not tap":    {Tap: open(unix.IFF_TUN | unix.IFF_NO_PI)},
		"multi queue tap": {Tap: open(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_MULTI_QUEUE)},
	} {
		err := checkNetwork(n)
		if !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%s: err = %v, want ErrInvalid", name, err)
		}
		// Start refuses it before anything runs.
		spec.Network = n
		if err := validateSpec(&spec); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%s: validateSpec: %v, want ErrInvalid", name, err)
		}
	}
}

func TestQEMUArgsNIC(t *testing.T) {
	s := &Substrate{accel: "tcg"}
	mac := net.HardwareAddr{2, 0x11, 0x22, 0x33, 0x44, 0x55}
	args := strings.Join(s.qemuArgs(launch{shape: machineShape{256, 1}, hostname: "h", tapFD: 8, mac: mac}), " ")
	if !strings.Contains(args, "-netdev tap,id=n0,fd=8 -device virtio-net-device,netdev=n0,mac=02:11:22:33:44:55 ") {
		t.Errorf("with a tap: %s", args)
	}
	args = strings.Join(s.qemuArgs(launch{shape: machineShape{256, 1}, hostname: "h", mac: defaultMAC}), " ")
	if strings.Contains(args, "-netdev") || !strings.Contains(args, "-device virtio-net-device,mac=02:53:50:41:43:45 ") {
		t.Errorf("without a tap: %s", args)
	}
	if !s.Capabilities().Tap {
		t.Error("Capabilities().Tap is false")
	}
}
