package main

import (
	"testing"

	"github.com/containerd/nri/pkg/api"
)

func TestParseCPUList(t *testing.T) {
	for _, tc := range []struct {
		text string
		want int
		bad  bool
	}{
		{"0-3,8", 5, false},
		{"", 0, false},
		{"7", 1, false},
		{"3-1", 0, true},
		{"a", 0, true},
		{"-1", 0, true},
		{"0-99999999", 0, true},
		{"0-65535,0-65535", 0, true},
	} {
		got, err := parseCPUList(tc.text)
		if (err != nil) != tc.bad || (!tc.bad && len(got) != tc.want) {
			t.Errorf("parseCPUList(%q) = %v, %v; want %d cpus, error %v", tc.text, got, err, tc.want, tc.bad)
		}
	}
}

func TestAnAssignmentOutsideTheNodeNeverReachesTheRuntime(t *testing.T) {
	shares := int64(1 << 30)
	p := &plugin{cpus: map[int]bool{0: true, 1: true, 2: true, 3: true}, mems: map[int]bool{0: true},
		assigned: map[string]given{
			"pod/ok":      {Cpus: "1-2", Mems: "0"},
			"pod/foreign": {Cpus: "2-9", Mems: "0"},
			"pod/mems":    {Cpus: "1", Mems: "0-1"},
			"pod/garbage": {Cpus: "1;rm -rf /", Mems: "0"},
			"pod/shares":  {Cpus: "1", Mems: "0", CPUShares: &shares},
		}}
	for name, want := range map[string]bool{"pod/ok": true, "pod/foreign": false, "pod/mems": false,
		"pod/garbage": false, "pod/shares": false, "pod/absent": false} {
		if _, ok := p.lookup(name); ok != want {
			t.Errorf("lookup(%s) usable = %v, want %v", name, ok, want)
		}
	}
}

func TestPodsAreFoundByUIDNeverByName(t *testing.T) {
	long := ""
	for i := 0; i < 200; i++ {
		long += "x"
	}
	a := &api.PodSandbox{Name: long + "a", Namespace: "ns", Uid: "uid-a"}
	b := &api.PodSandbox{Name: long + "b", Namespace: "ns", Uid: "uid-b"}
	if workloadName(a) == workloadName(b) || workloadName(a) != "pod/uid-a" {
		t.Fatalf("workload names %q and %q", workloadName(a), workloadName(b))
	}
}
