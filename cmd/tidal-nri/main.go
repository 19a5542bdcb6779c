// tidal-nri: Tidal as an NRI plugin (Node Resource Interface, containerd >= 1.7 / 2.x, CRI-O >= 1.26).
//
// The runtime itself applies each container's cpuset (cpus and mems) and cpu weight when it creates the
// container, from what the Tidal agent assigned the container's pod, so a container's first instruction
// already runs where Tidal put it; when Tidal's pools move, running containers are updated through the
// runtime (UpdateContainers), so Tidal and the runtime never write the same cpuset against each other.
//
// The agent is asked over its unix socket (GET /v1/assignments, answered from the agent's memory). This
// plugin keeps a copy refreshed every --refresh and answers the runtime from it: the runtime gives a
// plugin 2 s per request and disconnects one that misses it. Only a pod the copy does not know yet
// (created within the last refresh) costs one bounded call to the agent (--agent-timeout). When the
// runtime restarts, the connection closes and the plugin registers again.
//
// The agent's own writes of the pod's cgroups (the kubelet-cgroups road) go on: they write what this
// plugin applies, so the two agree; where NRI is absent, that road alone confines pods.
//
// A pod's workload is "pod/<uid>", the uid the runtime gives the sandbox (the kubelet's: a static pod's
// config hash): never a name another client of the agent could take. What the agent answers is checked
// before the runtime sees it: cpus among the node's online cpus, mems among its nodes with memory, else
// no adjustment (and a log line); the runtime is never handed a cpuset the kernel would refuse.
//
// The plugin needs no root: it reads the agent's read-only plugin socket (the agent's --plugin-socket,
// owned by the plugin's uid) and talks to the runtime's NRI socket.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/containerd/nri/pkg/api"
	"github.com/containerd/nri/pkg/stub"
)

// given is what the agent assigned one workload (GET /v1/assignments).
type given struct {
	QoS       string `json:"qos"`
	Cpus      string `json:"cpus"`
	Mems      string `json:"mems"`
	CPUShares *int64 `json:"cpu_shares"`
	CPUIdle   bool   `json:"cpu_idle"`
}

// tracked is a container this plugin adjusted or will, with what it last applied.
type tracked struct {
	workload string
	applied  given
}

type plugin struct {
	stub    stub.Stub
	agent   *http.Client
	timeout time.Duration

	mu         sync.Mutex
	assigned   map[string]given    // workload name -> assignment
	containers map[string]*tracked // container id -> what it was given
	known      bool                // at least one answer from the agent
	registered bool                // the runtime synchronized with this plugin (and has not closed)

	cpus map[int]bool // the node's online cpus: an assignment outside them is refused
	mems map[int]bool // its NUMA nodes with memory
}

// workloadName is the name the agent gives a pod's workload: "pod/<uid>" (contracts/pods.py).
func workloadName(pod *api.PodSandbox) string {
	return "pod/" + pod.GetUid()
}

// parseCPUList reads the kernel's list format ("0-3,8"); bounded so a hostile answer cannot make it
// allocate without limit.
func parseCPUList(text string) (map[int]bool, error) {
	out := map[int]bool{}
	text = strings.TrimSpace(text)
	if text == "" {
		return out, nil
	}
	for _, part := range strings.Split(text, ",") {
		lo, hi, found := strings.Cut(part, "-")
		a, err := strconv.Atoi(lo)
		if err != nil || a < 0 {
			return nil, fmt.Errorf("bad cpu list %q", text)
		}
		b := a
		if found {
			if b, err = strconv.Atoi(hi); err != nil || b < a {
				return nil, fmt.Errorf("bad cpu list %q", text)
			}
		}
		if b >= 1<<16 || len(out)+(b-a) > 1<<16 {
			return nil, fmt.Errorf("cpu list %q is larger than any node", text)
		}
		for i := a; i <= b; i++ {
			out[i] = true
		}
	}
	return out, nil
}

func readList(path string) map[int]bool {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil
	}
	set, err := parseCPUList(string(raw))
	if err != nil {
		return nil
	}
	return set
}

// valid says why the agent's answer for a workload cannot go to the runtime ("" when it can).
func (p *plugin) valid(g given) string {
	cpus, err := parseCPUList(g.Cpus)
	if err != nil || len(cpus) == 0 {
		return fmt.Sprintf("cpus %q: not a cpu list", g.Cpus)
	}
	for c := range cpus {
		if p.cpus != nil && !p.cpus[c] {
			return fmt.Sprintf("cpus %q: cpu %d is not an online cpu of this node", g.Cpus, c)
		}
	}
	mems, err := parseCPUList(g.Mems)
	if err != nil {
		return fmt.Sprintf("mems %q: not a node list", g.Mems)
	}
	for m := range mems {
		if p.mems != nil && !p.mems[m] {
			return fmt.Sprintf("mems %q: node %d has no memory here", g.Mems, m)
		}
	}
	if g.CPUShares != nil && (*g.CPUShares < 2 || *g.CPUShares > 262144) {
		return fmt.Sprintf("cpu_shares %d: outside 2..262144", *g.CPUShares)
	}
	return ""
}

func (p *plugin) fetch(timeout time.Duration) (map[string]given, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://tidal/v1/assignments", nil)
	if err != nil {
		return nil, err
	}
	// the agent's `tidal status` tells from this whether pods are confined at creation by the runtime
	req.Header.Set("X-Tidal-NRI", p.registration())
	resp, err := p.agent.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("agent answered %s", resp.Status)
	}
	var doc struct {
		Assignments map[string]given `json:"assignments"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&doc); err != nil {
		return nil, fmt.Errorf("agent's answer: %w", err)
	}
	return doc.Assignments, nil
}

func (p *plugin) registration() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.registered {
		return "registered"
	}
	return "connecting"
}

func (p *plugin) refresh(timeout time.Duration) error {
	assigned, err := p.fetch(timeout)
	if err != nil {
		return err
	}
	p.mu.Lock()
	p.assigned, p.known = assigned, true
	p.mu.Unlock()
	return nil
}

func (p *plugin) lookup(name string) (given, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.usable(name)
}

// usable: the assignment of a workload, if the agent has one and it may go to the runtime (p.mu held).
func (p *plugin) usable(name string) (given, bool) {
	g, ok := p.assigned[name]
	if !ok || g.Cpus == "" {
		return g, false
	}
	if why := p.valid(g); why != "" {
		log.Printf("%s: the agent's assignment is refused: %s (no adjustment)", name, why)
		return g, false
	}
	return g, true
}

func adjustment(g given) *api.ContainerAdjustment {
	adj := &api.ContainerAdjustment{}
	adj.SetLinuxCPUSetCPUs(g.Cpus)
	if g.Mems != "" {
		adj.SetLinuxCPUSetMems(g.Mems)
	}
	if g.CPUShares != nil && *g.CPUShares > 0 {
		adj.SetLinuxCPUShares(uint64(*g.CPUShares))
	}
	return adj
}

func update(id string, g given) *api.ContainerUpdate {
	u := &api.ContainerUpdate{}
	u.SetContainerId(id)
	u.SetLinuxCPUSetCPUs(g.Cpus)
	if g.Mems != "" {
		u.SetLinuxCPUSetMems(g.Mems)
	}
	if g.CPUShares != nil && *g.CPUShares > 0 {
		u.SetLinuxCPUShares(uint64(*g.CPUShares))
	}
	u.SetIgnoreFailure() // a container that exited meanwhile is not an error
	return u
}

// CreateContainer: the container's cpuset and weight, before its first instruction runs.
func (p *plugin) CreateContainer(_ context.Context, pod *api.PodSandbox, ctr *api.Container) (*api.ContainerAdjustment, []*api.ContainerUpdate, error) {
	name := workloadName(pod)
	g, ok := p.lookup(name)
	if !ok {
		// a pod admitted within the last refresh: one bounded call, well inside the runtime's deadline
		if err := p.refresh(p.timeout); err != nil {
			log.Printf("create %s/%s: agent: %v (no adjustment; the agent's cgroup writes will confine it)", name, ctr.GetName(), err)
		}
		g, ok = p.lookup(name)
	}
	p.mu.Lock()
	t := &tracked{workload: name}
	if ok {
		t.applied = g
	}
	p.containers[ctr.GetId()] = t
	p.mu.Unlock()
	if !ok {
		return nil, nil, nil
	}
	log.Printf("create %s/%s: cpus %s mems %s", name, ctr.GetName(), g.Cpus, g.Mems)
	return adjustment(g), nil, nil
}

// Synchronize: the containers that ran before this plugin registered (first start, or a runtime or
// plugin restart), brought to what the agent assigns now.
func (p *plugin) Synchronize(_ context.Context, pods []*api.PodSandbox, ctrs []*api.Container) ([]*api.ContainerUpdate, error) {
	if err := p.refresh(p.timeout); err != nil {
		log.Printf("synchronize: agent: %v", err)
	}
	byID := map[string]*api.PodSandbox{}
	for _, pod := range pods {
		byID[pod.GetId()] = pod
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	var updates []*api.ContainerUpdate
	for _, ctr := range ctrs {
		pod, ok := byID[ctr.GetPodSandboxId()]
		if !ok {
			continue
		}
		t := &tracked{workload: workloadName(pod)}
		p.containers[ctr.GetId()] = t
		if g, ok := p.usable(t.workload); ok {
			t.applied = g
			updates = append(updates, update(ctr.GetId(), g))
		}
	}
	p.registered = true
	log.Printf("synchronized: %d containers, %d updated", len(ctrs), len(updates))
	return updates, nil
}

func (p *plugin) RemoveContainer(_ context.Context, _ *api.PodSandbox, ctr *api.Container) error {
	p.mu.Lock()
	delete(p.containers, ctr.GetId())
	p.mu.Unlock()
	return nil
}

// follow refreshes the copy and updates the running containers whose assignment moved.
func (p *plugin) follow(ctx context.Context, every time.Duration) {
	ticker := time.NewTicker(every)
	defer ticker.Stop()
	failing := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
		}
		if err := p.refresh(p.timeout); err != nil {
			if !failing {
				log.Printf("agent: %v (keeping the last assignments)", err)
			}
			failing = true
			continue
		}
		failing = false
		var updates []*api.ContainerUpdate
		p.mu.Lock()
		for id, t := range p.containers {
			g, ok := p.usable(t.workload)
			if ok && (g.Cpus != t.applied.Cpus || g.Mems != t.applied.Mems ||
				!sameShares(g.CPUShares, t.applied.CPUShares)) {
				updates = append(updates, update(id, g))
				t.applied = g
			}
		}
		s := p.stub
		p.mu.Unlock()
		if len(updates) > 0 && s != nil {
			if failed, err := s.UpdateContainers(updates); err != nil || len(failed) > 0 {
				log.Printf("update %d containers: %v (%d failed)", len(updates), err, len(failed))
			} else {
				log.Printf("updated %d containers to their moved assignments", len(updates))
			}
		}
	}
}

func sameShares(a, b *int64) bool {
	return (a == nil && b == nil) || (a != nil && b != nil && *a == *b)
}

func main() {
	agentSocket := flag.String("agent-socket", "/run/tidal/plugin.sock", "the Tidal agent's plugin socket (read-only)")
	sysRoot := flag.String("sys", "/sys", "where sysfs is (the node's online cpus and memory nodes)")
	nriSocket := flag.String("nri-socket", "/var/run/nri/nri.sock", "the runtime's NRI socket")
	pluginIdx := flag.String("index", "10", "the plugin's index (order among NRI plugins)")
	refresh := flag.Duration("refresh", 250*time.Millisecond, "how often the copy of the agent's assignments is refreshed")
	agentTimeout := flag.Duration("agent-timeout", 500*time.Millisecond, "longest wait for the agent inside a runtime request")
	flag.Parse()
	log.SetFlags(log.LstdFlags | log.Lmicroseconds)
	log.SetPrefix("tidal-nri: ")

	p := &plugin{
		timeout:    *agentTimeout,
		assigned:   map[string]given{},
		containers: map[string]*tracked{},
		cpus:       readList(*sysRoot + "/devices/system/cpu/online"),
		mems:       readList(*sysRoot + "/devices/system/node/has_memory"),
		agent: &http.Client{Transport: &http.Transport{
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				var d net.Dialer
				return d.DialContext(ctx, "unix", *agentSocket)
			},
			MaxIdleConns: 2,
		}},
	}
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer cancel()
	go p.follow(ctx, *refresh)

	backoff := time.Second
	for ctx.Err() == nil {
		s, err := stub.New(p, stub.WithPluginName("tidal"), stub.WithPluginIdx(*pluginIdx),
			stub.WithSocketPath(*nriSocket), stub.WithOnClose(func() { log.Printf("the runtime closed the connection") }))
		if err != nil {
			log.Printf("%v", err)
			os.Exit(1)
		}
		p.mu.Lock()
		p.stub = s
		p.mu.Unlock()
		started := time.Now()
		// the stub's Run returns when its connection ends, not when ctx does: a SIGTERM stops it here, else the
		// plugin outlived every stop of its pod by the whole grace period (30 s in the node tier's teardowns)
		stopped := make(chan struct{})
		go func() {
			select {
			case <-ctx.Done():
				s.Stop()
			case <-stopped:
			}
		}()
		err = s.Run(ctx)
		close(stopped)
		p.mu.Lock()
		p.stub, p.registered = nil, false
		p.mu.Unlock()
		if ctx.Err() != nil {
			break
		}
		if time.Since(started) > time.Minute {
			backoff = time.Second
		}
		log.Printf("connection to %s ended (%v); registering again in %s", *nriSocket, err, backoff)
		select {
		case <-ctx.Done():
		case <-time.After(backoff):
		}
		if backoff < 16*time.Second {
			backoff *= 2
		}
	}
	log.Printf("stopping")
}
