// MiniMax Hotfix in ComfyUI's browser UI: node menu entries and workflow commands that move a workflow onto the
// pack. The swap itself runs on the server (POST /minimax_hotfix/swap, the pack's swap_loaders.py), so the
// browser and the command line give the same result; swap_rules.js (generated from the tool) decides which nodes
// get which entry. A change is loaded as one step of the workflow's undo history. When a prompt fails with an error
// that one of the pack's fixes repairs (POST /minimax_hotfix/known_error, the pack's registry/known_errors.py), a
// notice names the bug and offers the fix, then a rerun.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { RULES } from "./swap_rules.js";

const FIX_COMMAND = "MiniMaxHotfix.FixWorkflow";
const REVERSE_COMMAND = "MiniMaxHotfix.ReverseWorkflow";
const EXPLAIN_SETTING = "MiniMaxHotfix.ExplainKnownErrors";
const FIX_EVERY_RUN_SETTING = "MiniMaxHotfix.FixEveryRun";  // registry/prompt_fixing.py reads it per user
const NOTICE_ID = "minimax-hotfix-known-error";
const NOT_ONE_UNDO_STEP = "this frontend's undo history could not be reached, so the change may not be one undo step: "
  + "to go back, use \"Undo MiniMax Hotfix in this workflow (back to stock loaders)\"";

function applyType(node) {
  // The Apply node type this node's outputs need, or null: an output of MODEL/CLIP/VAE (or raylight's RAY_ACTORS)
  // without an input of that type.
  const type = node.type ?? node.constructor?.comfyClass;
  if (!type || type in RULES.stock_to_pack || type.startsWith(RULES.pack_node_prefix)) return null;
  if (RULES.pass_through_types.includes(type) || node.isSubgraphNode?.()) return null;
  const inputTypes = new Set((node.inputs ?? []).map((slot) => slot.type));
  const wanted = (node.outputs ?? [])
    .filter((slot) => slot.type in RULES.apply_node && !inputTypes.has(slot.type) && slot.links?.length)
    .map((slot) => RULES.apply_node[slot.type][0]);
  return wanted.length ? wanted.join(", ") : null;
}

function toast(severity, summary, detail) {
  app.extensionManager.toast.add({ severity, summary, detail, life: 6000 });
}

function trackerWeKnow(tracker) {
  // The change tracker keeps its history in fields the frontend does not publish (undoQueue, redoQueue, activeState,
  // _restoringState): where a frontend renamed them, the swap cannot be made one undo step and says so.
  return !!tracker && typeof tracker.captureCanvasState === "function" && Array.isArray(tracker.undoQueue)
    && Array.isArray(tracker.redoQueue) && "activeState" in tracker && "_restoringState" in tracker;
}

async function loadAsOneStep(workflow, graph) {
  // Loads `graph` into the open workflow the way the frontend's own undo/redo does (ChangeTracker.updateState):
  // with the tracker marked as restoring, the load keeps the tracker's history and state instead of resetting
  // them; capturing afterwards makes the whole change one undo step and marks the workflow modified. Returns whether
  // the change is one undo step.
  const tracker = workflow?.changeTracker;
  const options = { checkForRerouteMigration: false };
  if (!trackerWeKnow(tracker)) {
    await app.loadGraphData(graph, false, false, workflow, options);
    return false;
  }
  tracker.captureCanvasState();
  const before = tracker.activeState;
  const steps = tracker.undoQueue.length;
  tracker._restoringState = true;
  try {
    await app.loadGraphData(graph, false, false, workflow, options);
  } finally {
    tracker._restoringState = false;
  }
  tracker.captureCanvasState();
  // Newer frontends (1.58) skip that capture while their load is still settling and then take the loaded graph as
  // the current state without an undo step (a debounced squashState): the step is recorded here instead.
  if (before !== undefined && tracker.undoQueue.length === steps) {
    const now = JSON.parse(JSON.stringify(app.rootGraph.serialize()));
    if (JSON.stringify(now) !== JSON.stringify(before)) {
      tracker.undoQueue.push(before);
      tracker.redoQueue.length = 0;
      tracker.activeState = now;
      tracker.updateModified?.(before);
    }
  }
  return tracker.undoQueue.length === steps + 1;
}

async function runSwap({ reverse = false, only = null } = {}) {
  // Serialises the whole workflow, lets the server swap it, loads the result into the same tab as one undo step.
  const workflow = app.extensionManager.workflow.activeWorkflow;
  const response = await api.fetchApi("/minimax_hotfix/swap", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ workflow: app.rootGraph.serialize(), reverse, only }),
  });
  const reply = await response.json();
  if (!response.ok) {
    toast("error", "MiniMax Hotfix", reply.error ?? `swap failed (${response.status})`);
    return reply;
  }
  const oneStep = !reply.changed || await loadAsOneStep(workflow, reply.workflow);
  const notes = [...reply.warnings];
  if (!oneStep) notes.push(NOT_ONE_UNDO_STEP);
  if (reply.kept.length) notes.push(`kept, not inserted by MiniMax Hotfix: ${reply.kept.join(", ")}`);
  toast(reply.changed ? "success" : "info", "MiniMax Hotfix", [reply.summary, ...notes].join("\n"));
  return reply;
}

function nodeTarget(node) {
  // The root graph's own id is no subgraph id: the swap names the top level null.
  return { graph: !node.graph || node.graph.isRootGraph ? null : node.graph.id, node: node.id };
}

function nodeByExecutionId(executionId) {
  // ComfyUI names a node inside a subgraph by the path of node ids down to it: "12:5" is node 5 of node 12's subgraph.
  let graph = app.rootGraph;
  let node = null;
  for (const id of String(executionId).split(":")) {
    node = graph?.getNodeById(id) ?? null;
    graph = node?.subgraph;
  }
  return node;
}

function showNotice(text, actions) {
  // A toast cannot hold buttons, so the notice is an element of its own; it stays until closed or replaced.
  document.getElementById(NOTICE_ID)?.remove();
  const notice = document.createElement("div");
  notice.id = NOTICE_ID;
  notice.setAttribute("role", "alert");
  Object.assign(notice.style, {
    position: "fixed", bottom: "64px", left: "50%", transform: "translateX(-50%)", zIndex: 10001, maxWidth: "640px",
    padding: "12px 16px", borderRadius: "8px", border: "1px solid var(--border-color)",
    background: "var(--comfy-menu-bg)", color: "var(--fg-color)", boxShadow: "0 4px 16px rgba(0, 0, 0, 0.4)",
  });
  const line = document.createElement("p");
  line.style.margin = "0 0 10px";
  line.textContent = `MiniMax Hotfix: ${text}`;
  const buttons = document.createElement("div");
  Object.assign(buttons.style, { display: "flex", gap: "8px", justifyContent: "flex-end" });
  for (const { label, run } of [...actions, { label: "Close", run: () => notice.remove() }]) {
    const button = document.createElement("button");
    button.textContent = label;
    Object.assign(button.style, { padding: "4px 12px", cursor: "pointer" });
    button.addEventListener("click", run);
    buttons.append(button);
  }
  notice.append(line, buttons);
  document.body.append(notice);
}

function fixThenOfferRerun(swap) {
  return async () => {
    const reply = await swap();
    if (!reply.changed) {
      document.getElementById(NOTICE_ID)?.remove();
      return;
    }
    showNotice(`${reply.summary}. Run the workflow again?`, [{ label: "Run again", run: () => {
      document.getElementById(NOTICE_ID)?.remove();
      app.queuePrompt(0);
    } }]);
  };
}

// The third answer: the server fixes this and every later prompt of this user (registry/prompt_fixing.py); the
// canvas keeps its stock loaders.
const fixEveryRun = {
  label: "Fix every run on this server",
  run: async () => {
    await app.extensionManager.setting.set(FIX_EVERY_RUN_SETTING, true);
    document.getElementById(NOTICE_ID)?.remove();
    app.queuePrompt(0);
  },
};

function showKnownError(reply) {
  const loader = reply.action === "insert_apply" ? nodeByExecutionId(reply.node) : null;
  if (loader) {
    showNotice(reply.text, [{ label: `Insert ${reply.apply} after ${loader.title ?? loader.type}`,
                              run: fixThenOfferRerun(() => runSwap({ only: nodeTarget(loader) })) }, fixEveryRun]);
  } else if (reply.action === "fix_workflow" || reply.action === "insert_apply") {
    showNotice(reply.text, [{ label: "Fix this workflow", run: fixThenOfferRerun(() => runSwap()) }, fixEveryRun]);
  } else {
    showNotice(reply.text, []);
  }
}

async function explainError({ detail }) {
  // The open workflow as it queues now stands for the one that failed: it is, unless it was edited since (the route
  // then finds another node type under the failing id and judges the error alone).
  if (!app.extensionManager.setting.get(EXPLAIN_SETTING)) return;
  const { output } = await app.graphToPrompt();
  const { node_id, node_type, exception_message, traceback } = detail;
  const response = await api.fetchApi("/minimax_hotfix/known_error", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ error: { node_id, node_type, exception_message, traceback }, prompt: output }),
  });
  const reply = response.ok ? await response.json() : { known: false };
  if (reply.known) showKnownError(reply);
}

app.registerExtension({
  name: "MiniMaxHotfix.Swap",
  settings: [
    { id: EXPLAIN_SETTING, category: ["MiniMax Hotfix", "Known errors", "Explain"], type: "boolean", defaultValue: true,
      name: "MiniMax Hotfix: explain known errors",
      tooltip: "When a run fails with an error that one of MiniMax Hotfix's fixes repairs, say which bug it is and " +
               "offer the fix." },
    { id: FIX_EVERY_RUN_SETTING, category: ["MiniMax Hotfix", "Server", "Fix every run"], type: "boolean",
      defaultValue: false, name: "MiniMax Hotfix: fix every run on this server",
      tooltip: "The server puts every workflow you run through MiniMax Hotfix's loaders, as Fix this workflow does, " +
               "without changing it on the canvas. Off by default; the server's MINIMAX_HOTFIX_FIX_EVERY_PROMPT, " +
               "where set, decides for everyone." },
  ],
  setup() {
    api.addEventListener("execution_error", explainError);
  },
  commands: [
    { id: FIX_COMMAND, label: "Fix this workflow with MiniMax Hotfix", function: () => runSwap() },
    { id: REVERSE_COMMAND, label: "Undo MiniMax Hotfix in this workflow (back to stock loaders)",
      function: () => runSwap({ reverse: true }) },
  ],
  menuCommands: [{ path: ["Extensions", "MiniMax Hotfix"], commands: [FIX_COMMAND, REVERSE_COMMAND] }],
  getNodeMenuItems(node) {
    const type = node.type ?? node.constructor?.comfyClass;
    const pack = RULES.stock_to_pack[type];
    if (pack) {
      return [{ content: `Replace with ${pack} (MiniMax Hotfix)`, callback: () => runSwap({ only: nodeTarget(node) }) }];
    }
    const apply = applyType(node);
    if (apply) {
      return [{ content: `Insert ${apply} after this node (MiniMax Hotfix)`,
                callback: () => runSwap({ only: nodeTarget(node) }) }];
    }
    return [];
  },
  getCanvasMenuItems() {
    return [{ content: "Fix this workflow with MiniMax Hotfix", callback: () => runSwap() }];
  },
});

export { runSwap };
