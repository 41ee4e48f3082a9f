//go:build linux && amd64

package ns

import "testing"

func TestSeccompProgramShape(t *testing.T) {
	p := seccompProgram()
	if len(p) > 4096 {
		t.Fatalf("program too long: %d", len(p))
	}
	if last := p[len(p)-1]; last.Code != bpfRET|bpfK || last.K != seccompRetAllow {
		t.Fatalf("program does not end in allow: %+v", last)
	}
	// Every jump stays inside the program.
	for i, ins := range p {
		if ins.Code&0x07 == bpfJMP {
			if i+1+int(ins.Jt) >= len(p) || i+1+int(ins.Jf) >= len(p) {
				t.Fatalf("instruction %d jumps out of the program", i)
			}
		}
	}
}
