package scheduler

import (
	"errors"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
)

func w(id string, load, capacity int) spacev1.Worker {
	return spacev1.Worker{ID: id, NodeURL: "http://" + id, State: StateReady, Load: load, Capacity: capacity}
}

func TestNoCapacity(t *testing.T) {
	s := New(2, rand.NewPCG(1, 2))
	cases := [][]spacev1.Worker{
		nil,
		{w("full", 4, 4)},
		{w("zero", 0, 0)},
		{{ID: "draining", NodeURL: "http://d", State: "draining", Capacity: 4}},
		{{ID: "nourl", State: StateReady, Capacity: 4}},
	}
	for i, ws := range cases {
		if _, err := s.Pick(ws); !errors.Is(err, ErrNoCapacity) {
			t.Errorf("case %d: %v, want ErrNoCapacity", i, err)
		}
	}
	if _, err := s.Pick([]spacev1.Worker{w("a", 0, 1)}, "a"); !errors.Is(err, ErrNoCapacity) {
		t.Errorf("excluded only worker: %v", err)
	}
}

func TestSingleAndExclude(t *testing.T) {
	s := New(0, nil)
	got, err := s.Pick([]spacev1.Worker{w("a", 3, 4), w("full", 9, 9)})
	if err != nil || got.ID != "a" {
		t.Fatalf("got %v %v", got.ID, err)
	}
	got, err = s.Pick([]spacev1.Worker{w("a", 0, 4), w("b", 3, 4)}, "a")
	if err != nil || got.ID != "b" {
		t.Fatalf("exclude: got %v %v", got.ID, err)
	}
}

// With K equal to the number of workers the least loaded (by ratio) always
// wins; ties break by load then id.
func TestBestOfAll(t *testing.T) {
	s := New(3, rand.NewPCG(3, 4))
	ws := []spacev1.Worker{w("a", 5, 10), w("b", 1, 4), w("c", 2, 10)}
	for i := 0; i < 50; i++ {
		got, _ := s.Pick(ws)
		if got.ID != "c" { // 0.2 < 0.25 < 0.5
			t.Fatalf("got %s want c", got.ID)
		}
	}
	tie := []spacev1.Worker{w("y", 2, 4), w("x", 1, 2), w("z", 2, 4)}
	for i := 0; i < 20; i++ {
		if got, _ := s.Pick(tie); got.ID != "x" {
			t.Fatalf("tie: got %s want x", got.ID)
		}
	}
}

// Best of 2 never picks the single most loaded worker and favours the
// least loaded ones.
func TestBestOfTwoDistribution(t *testing.T) {
	s := New(2, rand.NewPCG(5, 6))
	ws := []spacev1.Worker{w("l0", 0, 10), w("l3", 3, 10), w("l6", 6, 10), w("l9", 9, 10)}
	counts := map[string]int{}
	for i := 0; i < 4000; i++ {
		got, err := s.Pick(ws)
		if err != nil {
			t.Fatal(err)
		}
		counts[got.ID]++
	}
	if counts["l9"] != 0 {
		t.Fatalf("most loaded picked %d times", counts["l9"])
	}
	if !(counts["l0"] > counts["l3"] && counts["l3"] > counts["l6"]) {
		t.Fatalf("distribution not ordered by load: %v", counts)
	}
	// l0 is in the sample with probability 1/2.
	if counts["l0"] < 1700 || counts["l0"] > 2300 {
		t.Fatalf("l0 picked %d/4000 times, want about 2000", counts["l0"])
	}
}

func TestPickDoesNotMutateInput(t *testing.T) {
	s := New(2, nil)
	ws := []spacev1.Worker{w("a", 0, 1), w("b", 0, 1), w("c", 0, 1)}
	cp := append([]spacev1.Worker(nil), ws...)
	for i := 0; i < 10; i++ {
		_, _ = s.Pick(ws)
	}
	for i := range ws {
		if ws[i].ID != cp[i].ID || ws[i].Load != cp[i].Load || ws[i].Capacity != cp[i].Capacity {
			t.Fatal("input reordered")
		}
	}
}

func TestConcurrent(t *testing.T) {
	s := New(2, nil)
	ws := []spacev1.Worker{w("a", 0, 1), w("b", 0, 1)}
	var wg sync.WaitGroup
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := 0; j < 100; j++ {
				if _, err := s.Pick(ws); err != nil {
					t.Error(err)
				}
			}
		}()
	}
	wg.Wait()
}

// No capacity is a class of its own for callers and unavailable (retry
// later) for the API edges.
func TestNoCapacityIsUnavailable(t *testing.T) {
	_, err := New(0, nil).Pick(nil)
	if !errors.Is(err, ErrNoCapacity) || !errors.Is(err, errdefs.ErrUnavailable) || ErrNoCapacity.Error() != "no worker with free capacity" {
		t.Fatalf("%v", err)
	}
}
