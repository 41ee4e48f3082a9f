package sbxmanager

import (
	"net/netip"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/identity"
)

// egressWithNetns is an Egress whose namespace holds microVM taps.
type egressWithNetns struct {
	Egress
	path string
}

func (e egressWithNetns) NetnsPath() string { return e.path }

// plainEgress is an Egress that does not say where its namespace is.
type plainEgress struct{ Egress }

// TestRecordTapGateway: a microVM's gateway state names the egress
// namespace (its inode at activation) and the VM's address on its link;
// without a link or an egress that says where its namespace is, none.
func TestRecordTapGateway(t *testing.T) {
	inst := &fakeInstance{route: identity.Route{SandboxID: "sbx1", WorkerID: "w1", Generation: 1}}
	link := &Link{Slot: 3, Gateway: netip.MustParseAddr("10.201.0.13"), Addr: netip.MustParsePrefix("10.201.0.14/30")}
	for name, m := range map[string]*Manager{"no egress": {}, "egress without a namespace path": {egress: plainEgress{}}} {
		if gs, err := m.recordTapGateway(inst, t.TempDir(), link); gs != nil || err != nil {
			t.Errorf("%s: %+v %v", name, gs, err)
		}
	}
	path := filepath.Join(t.TempDir(), "egress.netns")
	m := &Manager{egress: egressWithNetns{path: path}}
	if _, err := m.recordTapGateway(inst, t.TempDir(), link); err == nil {
		t.Fatal("a missing namespace was recorded")
	}
	if gs, err := m.recordTapGateway(inst, t.TempDir(), nil); gs != nil || err != nil {
		t.Fatalf("no link: %+v %v", gs, err)
	}
	if err := writeEmpty(path); err != nil {
		t.Fatal(err)
	}
	gs, err := m.recordTapGateway(inst, t.TempDir(), link)
	if err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	if gs.netnsPath != path || gs.netnsIno != st.Ino || gs.dialAddr != netip.MustParseAddr("10.201.0.14") || gs.route != inst.route || gs.initPID != 0 {
		t.Fatalf("state %+v", gs)
	}
}

func writeEmpty(p string) error {
	fd, err := unix.Open(p, unix.O_CREAT|unix.O_WRONLY|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	return unix.Close(fd)
}
