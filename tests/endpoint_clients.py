"""Agents written against an OpenAI-compatible API, as users write them, for the endpoint's tests. The
`openai-agent` plugin imports them by name (`tests.endpoint_clients:openai_tools_run`); what they got back is
kept here for the tests to check."""

import asyncio
import json
import os
import shutil
from pathlib import Path

import anthropic  # here, not in a run: imported on the worker's event loop, it held every episode's calls meanwhile
import httpx
import openai
from openai.lib.streaming.chat import ChatCompletionStreamState

from rlsys.endpoint.http_client import shared_http_client

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "arithmetic",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}},
                                                          "required": ["expression"]}}}]
RESPONSES: list = []  # what the functions got back, per call
SEEN: dict = {}  # what probing_run observed


async def openai_tools_run(base_url, api_key, prompt, stream: bool = False):
    """A hand-written tool loop on the real `openai` client; streamed, each reply as the client reassembles it."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": prompt}]
    for _ in range(3):
        response = await client.chat.completions.create(model="rlsys", messages=messages, tools=TOOLS, logprobs=True,
                                                        seed=7, stream=stream, extra_body={"return_token_ids": True})
        if stream:
            state = ChatCompletionStreamState()
            async for chunk in response:
                state.handle_chunk(chunk)
            response = state.get_final_completion()
        RESPONSES.append(response)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return float(message.content == "409")
        for call in message.tool_calls:
            result = str(eval(json.loads(call.function.arguments)["expression"]))  # the test's own calculator
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0


async def openai_streaming_tools_run(base_url, api_key, prompt):
    return await openai_tools_run(base_url, api_key, prompt, stream=True)


RESPONSES_TOOLS = [{"type": "function", "name": "calculator", "description": "arithmetic", "strict": True,
                    "parameters": TOOLS[0]["function"]["parameters"]}]  # the Responses API's flat shape


async def responses_tools_run(base_url, api_key, prompt, stream: bool = False):
    """The tool loop on the Responses API (`client.responses.create`), as OpenAI documents it: the input grows by
    the response's output items and each function call's output; streamed, each response is the one
    `response.completed` carries."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    items = [{"role": "user", "content": prompt}]
    for _ in range(3):
        response = await client.responses.create(model="rlsys", instructions="Use the calculator.", input=items,
                                                 tools=RESPONSES_TOOLS, store=False, stream=stream)
        if stream:
            events = [event async for event in response]
            RESPONSES.append(events)
            response = events[-1].response
        RESPONSES.append(response)
        items += [item.model_dump(exclude_none=True) for item in response.output]
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            return float(response.output_text == "409")
        for call in calls:
            result = str(eval(json.loads(call.arguments)["expression"]))  # the test's own calculator
            items.append({"type": "function_call_output", "call_id": call.call_id, "output": result})
    return 0.0


async def responses_streaming_tools_run(base_url, api_key, prompt):
    return await responses_tools_run(base_url, api_key, prompt, stream=True)


async def responses_run(base_url, api_key, prompt):
    """The plainest agent on the Responses API: one call, a string input; the environment scores the answer."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=shared_http_client())
    await client.responses.create(model="rlsys", input=prompt)
    return None


ANTHROPIC_TOOLS = [{"name": "calculator", "description": "arithmetic",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]  # the Messages API's shape


def anthropic_client(base_url, api_key):
    """The real `anthropic` client on the endpoint: its base URL is the server's root (the client adds /v1/messages).
    Over the worker's shared pools, as the OpenAI example's: a client of its own per run made an SSL context and a
    connection per call, and in the full loop under CI's load calls timed out connecting (the client's 5 s)."""
    return anthropic.AsyncAnthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key, max_retries=0,
                                    http_client=shared_http_client())


async def anthropic_tools_run(base_url, api_key, prompt, stream: bool = False):
    """The tool loop on Anthropic's Messages API as its docs write it: the assistant's content blocks sent back as
    they came, then a user turn of tool_result blocks; streamed, each reply the stream's final message."""
    client = anthropic_client(base_url, api_key)
    messages = [{"role": "user", "content": prompt}]
    for _ in range(3):
        asked = dict(model="rlsys", max_tokens=128, system="Use the calculator.", messages=messages,
                     tools=ANTHROPIC_TOOLS)
        if stream:
            async with client.messages.stream(**asked) as events:
                message = await events.get_final_message()
        else:
            message = await client.messages.create(**asked)
        RESPONSES.append(message)
        messages.append({"role": "assistant", "content": message.content})
        calls = [block for block in message.content if block.type == "tool_use"]
        if not calls:
            return float(message.content[0].text == "409")
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": str(eval(call.input["expression"]))}
            for call in calls]})  # the test's own calculator
    return 0.0


async def anthropic_streaming_tools_run(base_url, api_key, prompt):
    return await anthropic_tools_run(base_url, api_key, prompt, stream=True)


async def anthropic_run(base_url, api_key, prompt):
    """The plainest agent on Anthropic's Messages API: one call, a string message; the environment scores the
    answer. max_tokens (which that API requires) is the experiment's gen.max_new_tokens."""
    await anthropic_client(base_url, api_key).messages.create(model="rlsys", max_tokens=8,
                                                              messages=[{"role": "user", "content": prompt}])
    return None


async def anthropic_cut_run(base_url, api_key, prompt):
    RESPONSES.append(await anthropic_client(base_url, api_key).messages.create(
        model="rlsys", max_tokens=2, messages=[{"role": "user", "content": prompt}]))
    return 0.0


async def langgraph_streaming_run(base_url, api_key, prompt):
    """The LangGraph example's agent, its model streaming and the graph run with stream_mode="messages"."""
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    from rlsys.impl.agent.langgraph_example import calculator

    model = ChatOpenAI(base_url=base_url, api_key=api_key, model="rlsys", max_retries=0, streaming=True,
                       stream_usage=True)
    agent = create_react_agent(model, [calculator])
    async for message, _ in agent.astream({"messages": [("user", prompt)]}, {"recursion_limit": 8},
                                          stream_mode="messages"):
        RESPONSES.append(message)
    return None


async def chat_anthropic_run(base_url, api_key, prompt, stream: bool = False):
    """The LangGraph example's agent on LangChain's ChatAnthropic: its model calls /v1/messages (tools bound by
    `create_react_agent` with bind_tools), streaming and the graph run with stream_mode="messages" where asked."""
    from langchain_anthropic import ChatAnthropic
    from langgraph.prebuilt import create_react_agent

    from rlsys.impl.agent.langgraph_example import calculator

    # max_tokens: its default (4096 for a model it does not know) is past the episode's context, and refused; so is
    # one past what the conversation leaves of it, as Anthropic refuses it (the test gives it room).
    model = ChatAnthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key, model="rlsys", max_tokens=128,
                          max_retries=0, streaming=stream)
    agent = create_react_agent(model, [calculator])
    if not stream:
        RESPONSES.extend((await agent.ainvoke({"messages": [("user", prompt)]}, {"recursion_limit": 8}))["messages"])
        return None
    async for message, _ in agent.astream({"messages": [("user", prompt)]}, {"recursion_limit": 8},
                                          stream_mode="messages"):
        RESPONSES.append(message)
    return None


async def chat_anthropic_streaming_run(base_url, api_key, prompt):
    return await chat_anthropic_run(base_url, api_key, prompt, stream=True)


CLAUDE_CODE: dict = {}  # the `claude` binary claude_code_run runs, its directories, its arguments and the settings
# (environment variables) a test adds


def claude_code_binary() -> str | None:
    """Claude Code's CLI: `claude` on PATH (npm's @anthropic-ai/claude-code), else the one the Claude Agent SDK bundles
    and runs (scripts/install.sh --tests installs the SDK); None where neither is installed."""
    on_path = shutil.which("claude")
    if on_path is not None:
        return on_path
    try:
        import claude_agent_sdk
    except ImportError:
        return None
    bundled = Path(claude_agent_sdk.__file__).parent / "_bundled" / "claude"  # where the SDK itself looks first
    return str(bundled) if bundled.is_file() else None


async def claude_code_run(base_url, api_key, prompt):
    """Claude Code itself (`claude -p`, the CLI the Claude Agent SDK drives) pointed at the endpoint, as its docs point
    it at a gateway: ANTHROPIC_BASE_URL the endpoint's root, the episode's key as ANTHROPIC_API_KEY, and nothing else
    of the endpoint's set (the other two keep it from calling home). Its home and working directory are the test's.
    Its result, as it prints it, is kept."""
    env = {"PATH": os.environ["PATH"], "HOME": str(CLAUDE_CODE["home"]), "ANTHROPIC_BASE_URL":
           base_url.removesuffix("/v1"), "ANTHROPIC_API_KEY": api_key,
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1", **CLAUDE_CODE["settings"]}
    process = await asyncio.create_subprocess_exec(
        CLAUDE_CODE["binary"], "-p", prompt, *CLAUDE_CODE["args"], "--output-format", "json", env=env,
        cwd=CLAUDE_CODE["cwd"], stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await process.communicate()
    finally:
        if process.returncode is None:  # the episode was cancelled: no claude outlives it
            process.kill()
            await process.wait()
    RESPONSES.append(json.loads(out) if out.strip() else {"returncode": process.returncode, "stderr": err.decode()})
    return None


async def claude_agent_sdk_run(base_url, api_key, prompt):
    """An agent on the Claude Agent SDK as its users write one: `query()` on the prompt with a calculator of its own
    (an in-process MCP tool, `@tool`), pointed at the endpoint by ANTHROPIC_BASE_URL and the episode's key. Claude Code
    defers MCP tools behind its ToolSearch: the model loads the calculator before it calls it. The messages it
    yields are kept; its reward is the answer's."""
    from claude_agent_sdk import ClaudeAgentOptions, ResultMessage, create_sdk_mcp_server, query, tool

    @tool("calculator", "Evaluates an arithmetic expression, such as 12*34+1.", {"expression": str})
    async def calculator(args):
        return {"content": [{"type": "text", "text": str(eval(args["expression"]))}]}  # the test's own calculator

    options = ClaudeAgentOptions(
        cli_path=CLAUDE_CODE["binary"], cwd=CLAUDE_CODE["cwd"], max_turns=4,
        mcp_servers={"math": create_sdk_mcp_server("math", tools=[calculator])},
        allowed_tools=["mcp__math__calculator"],
        env={"HOME": str(CLAUDE_CODE["home"]), "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"),
             "ANTHROPIC_API_KEY": api_key, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"})
    async for message in query(prompt=prompt, options=options):  # read to its end: the CLI's process with it
        RESPONSES.append(message)
    result = RESPONSES[-1]
    return float(isinstance(result, ResultMessage) and result.result == "409")


async def editing_run(base_url, api_key, prompt):
    """A client that rewrites the model's first answer, then goes on from the rewritten history."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": prompt}]
    for follow_up in ("again", "more", None):
        response = await client.chat.completions.create(model="rlsys", messages=messages,
                                                        extra_body={"return_token_ids": True})
        RESPONSES.append(response)
        if follow_up is None:
            return 0.5
        reply = response.choices[0].message.model_dump(exclude_none=True)
        if follow_up == "again":
            reply["content"] = "edited"  # what the model said is not what the client sends back
        messages += [reply, {"role": "user", "content": follow_up}]


async def probing_run(base_url, api_key, prompt):
    """Refusals: a wrong key, a bad request, and what models lists."""
    async with httpx.AsyncClient(base_url=base_url) as http:
        SEEN["wrong_key"] = (await http.get("/models", headers={"Authorization": "Bearer nope"})).status_code
        SEEN["models"] = (await http.get("/models", headers={"Authorization": f"Bearer {api_key}"})).json()
        SEEN["bad"] = (await http.post("/chat/completions", json={"messages": []},
                                       headers={"Authorization": f"Bearer {api_key}"})).status_code
    SEEN["key"], SEEN["base_url"] = api_key, base_url
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    completion = await client.completions.create(model="rlsys", prompt="12+34=", max_tokens=4)
    SEEN["completion"] = completion.choices[0].text
    return 1.0


async def failing_run(base_url, api_key, prompt):
    raise RuntimeError("the user's agent broke")


async def hanging_run(base_url, api_key, prompt):
    await asyncio.sleep(3600)


async def own_timeout_run(base_url, api_key, prompt):
    raise TimeoutError("the user's HTTP call timed out")





async def responses_cut_run(base_url, api_key, prompt):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    RESPONSES.append(await client.responses.create(model="rlsys", input=prompt, max_output_tokens=2))
    return 0.0


async def agents_sdk_run(base_url, api_key, prompt, stream: bool = False):
    """An OpenAI Agents SDK agent with one function tool, on its default model class (the Responses API); streamed,
    run as `Runner.run_streamed`, which reads the events."""
    from agents import Agent, OpenAIResponsesModel, RunConfig, Runner, function_tool

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluates an arithmetic expression, such as 12*34+1."""
        return str(eval(expression))  # the test's own calculator

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    agent = Agent(name="calculator", instructions="Use the calculator.", tools=[calculator],
                  model=OpenAIResponsesModel(model="rlsys", openai_client=client))
    config = RunConfig(tracing_disabled=True)
    if stream:
        result = Runner.run_streamed(agent, prompt, max_turns=4, run_config=config)
        async for _ in result.stream_events():
            pass
    else:
        result = await Runner.run(agent, prompt, max_turns=4, run_config=config)
    RESPONSES.extend(result.raw_responses)
    return float(result.final_output == "409")


async def agents_sdk_streamed_run(base_url, api_key, prompt):
    return await agents_sdk_run(base_url, api_key, prompt, stream=True)
